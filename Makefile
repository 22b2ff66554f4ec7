# The two commands of the quick start: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PG_URL ?= postgres://postgres@127.0.0.1:5432/postgres
PORT   ?= 8000

.PHONY: demo test test-postgresql lint venv lock clean

$(VENV)/.installed: requirements.txt requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

venv: $(VENV)/.installed

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

## Lint, then the whole suite on SQLite and the database-dependent tests (marked `postgresql`,
## see tests/conftest.py) on PostgreSQL, side by side (.ci/test-passes; TEST_PASSES=serial for
## one after the other). Redis and PostgreSQL are started if down.
## `make test-postgresql` runs the whole suite on PostgreSQL.
test: venv
	bash .ci/ensure-services
	bash .ci/ensure-browser
	$(VENV)/bin/ruff check .
	$(PY) manage.py makemigrations --check --dry-run --settings=settings.test
	VENV=$(VENV) PG_URL=$(PG_URL) bash .ci/test-passes

test-postgresql: venv
	bash .ci/ensure-services
	DATABASE_URL=$(PG_URL) $(VENV)/bin/pytest -q

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) var
