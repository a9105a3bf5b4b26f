# The example's image (see docker-compose.yml): celery-fanin installed editable, plus the example_app package.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONPATH=/app \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# The library and its dependencies first: editing the example does not reinstall them.
COPY pyproject.toml README.md ./
COPY celery_fanin ./celery_fanin
# binary: python:3.11-slim has no libpq, so psycopg brings its own
RUN pip install -e ".[redis,binary]"

COPY example_app ./example_app

# Celery warns against running workers as root.
RUN useradd --create-home --uid 10001 app
USER app

CMD ["python", "-m", "example_app.demo", "--no-spawn"]
