# The two commands of the quick start: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The tasks tests also run on the newest Django 6 (`django.tasks` in core), which needs Python >= 3.12.
PYTHON_DJANGO6 ?= $(shell for p in python3.13 python3.12 /root/.pyenv/versions/3.1[2-9]*/bin/python; do \
	"$$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { command -v "$$p"; break; }; done)
VENV_DJANGO6   ?= .venv-django6
PG_URL ?= postgres://postgres@127.0.0.1:5432/postgres
PORT   ?= 8000
DOCS_PORT ?= 8001
# mkdocs-material prints an end-of-life banner on every build. No --quiet: it also stops --strict
# from counting warnings, so a broken link would pass.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs

.PHONY: demo test test-postgresql test-django6 test-host-project lint docs venv venv-django6 lock clean

$(VENV)/.installed: requirements.txt requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

venv: $(VENV)/.installed

$(VENV_DJANGO6)/.installed: requirements-django6.txt pyproject.toml
	@test -n "$(PYTHON_DJANGO6)" || { echo "Django 6 needs Python >= 3.12: none found (set PYTHON_DJANGO6)" >&2; exit 1; }
	$(PYTHON_DJANGO6) -m venv $(VENV_DJANGO6)
	$(VENV_DJANGO6)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_DJANGO6)/bin/python -m pip install --quiet -r requirements-django6.txt
	$(VENV_DJANGO6)/bin/python -m pip install --quiet --no-deps -e .
	touch $@

venv-django6: $(VENV_DJANGO6)/.installed

## Recompile requirements.lock from pyproject.toml's ranges (every extra), keeping the pinned
## versions that still fit; `uv` is fetched into a throwaway venv if it is not on the PATH.
lock:
	@command -v uv >/dev/null || { $(PYTHON) -m venv var/uv && var/uv/bin/pip install --quiet uv; }
	$$(command -v uv || echo var/uv/bin/uv) pip compile pyproject.toml --all-extras --python-version 3.11 \
		-o requirements.lock --annotation-style line --custom-compile-command "make lock"

## The main job on the embedded default: SQLite + db transport + db admission, no Redis.
## `make demo PORT=8001` serves on another port; a port in use is an error (exit 1).
demo: venv
	$(PY) manage.py migrate --noinput
	DEMO_PORT=$(PORT) exec $(PY) -m examples.demo

## Lint, then the whole suite on SQLite in two shards (pytest-split, balanced by
## .ci/test-durations.json, each on its own SQLite file and Redis database; a check that they ran
## every test exactly once), the database-dependent tests (marked `postgresql`, see
## tests/conftest.py) on PostgreSQL (the soaks apart, the rest in two shards), the tasks tests on Django 6, and the host-project test (the
## wheel in a fresh `startproject` wired by docs/add-to-your-project.md, Django 5.2 and 6.x), side
## by side (.ci/test-passes: one line per pass with its result and time; SQLITE_SHARDS=1|2|3,
## TEST_PASSES=serial for one after the other, unsharded). Redis and PostgreSQL are started if
## down. `make test-postgresql` runs the whole suite on PostgreSQL; `make test-django6` the tasks
## tests on Django 6 alone; `make test-host-project` the host-project test alone.
test: venv venv-django6
	bash .ci/ensure-services
	bash .ci/ensure-browser
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(MKDOCS) build --strict
	$(PY) manage.py makemigrations --check --dry-run --settings=settings.test
	VENV=$(VENV) VENV_DJANGO6=$(VENV_DJANGO6) PG_URL=$(PG_URL) PYTHON=$(PYTHON) \
		PYTHON_DJANGO6=$(PYTHON_DJANGO6) bash .ci/test-passes

test-postgresql: venv
	bash .ci/ensure-services
	DATABASE_URL=$(PG_URL) $(VENV)/bin/pytest -q

test-django6: venv-django6
	bash .ci/ensure-services
	VENV_DJANGO6=$(VENV_DJANGO6) TEST_PASSES=django6 bash .ci/test-passes

test-host-project: venv
	VENV=$(VENV) PYTHON=$(PYTHON) PYTHON_DJANGO6=$(PYTHON_DJANGO6) TEST_PASSES=host bash .ci/test-passes

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(MKDOCS) build --strict

## The docs/ folder as a site (mkdocs.yml) on http://127.0.0.1:$(DOCS_PORT)/, rebuilt on every
## edit; `make test` and `make lint` build it with --strict into var/site.
docs: venv
	$(MKDOCS) serve --strict --dev-addr 127.0.0.1:$(DOCS_PORT)

clean:
	rm -rf $(VENV) $(VENV_DJANGO6) var
