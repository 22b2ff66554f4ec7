"""The forms an operator fills in to act on runs, shared by the admin and the dashboard: start a
run of a registered workflow, send a signal. Each validates what the operation will be given
(a workflow that may be started, strict JSON of bounded depth, names the database can store)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.core.exceptions import ValidationError
from django.forms.fields import InvalidJSONInput

from durable_flow.config.limits import RUN_ID_LENGTH, SIGNAL_NAME_LENGTH
from durable_flow.config.validation import MAX_JSON_DEPTH, StrictJSONDecoder, bounded_depth
from durable_flow.definitions.registry import startable_workflows


class JSONInputField(forms.JSONField):
    """Strict JSON typed into a form, nested at most `MAX_JSON_DEPTH` deep: deeper, or `NaN` and
    the infinities (`StrictJSONDecoder`), is a form error, and the form shows the text back as
    typed (decoding or re-encoding it could exhaust the stack)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(decoder=StrictJSONDecoder, **kwargs)

    def to_python(self, value: Any) -> Any:
        try:
            return bounded_depth(super().to_python(value), "JSON")
        except RecursionError:
            raise ValidationError(f"JSON is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid") from None
        except ValueError as exc:  # too deep (`InvalidInput`), or a constant strict JSON has not
            raise ValidationError(str(exc), code="invalid") from None

    def bound_data(self, data: Any, initial: Any) -> Any:
        try:
            return bounded_depth(super().bound_data(data, initial), "JSON")
        except (RecursionError, ValueError):
            return InvalidJSONInput(data)


class StartForm(forms.Form):
    """Start a run of a registered workflow."""

    workflow = forms.ChoiceField(choices=())
    input = JSONInputField(required=False, help_text='JSON, e.g. {"account": 42}')
    run_id = forms.CharField(
        required=False, max_length=RUN_ID_LENGTH, help_text="Optional; makes the start idempotent."
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["workflow"].choices = [(name, name) for name in sorted(startable_workflows())]


class SignalForm(forms.Form):
    """Send a named signal with a JSON payload."""

    name = forms.CharField(max_length=SIGNAL_NAME_LENGTH)
    payload = JSONInputField(required=False)
