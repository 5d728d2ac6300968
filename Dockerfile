# maintd: slim, non-root image. Build: docker build -t maintd .
# Dependencies come from requirements.lock (exact versions, hash-checked), then maintd itself
# without resolving anything again: the same install as the README's production section.
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY requirements.lock ./
RUN python -m venv /opt/maintd \
 && /opt/maintd/bin/pip install --no-cache-dir --require-hashes -r requirements.lock
COPY pyproject.toml README.md ./
COPY maintd ./maintd
COPY migrations ./migrations
RUN /opt/maintd/bin/pip install --no-cache-dir --no-deps . && /opt/maintd/bin/pip check

FROM python:3.11-slim-bookworm
COPY --from=build /opt/maintd /opt/maintd
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin maintd
ENV PATH=/opt/maintd/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 9464
ENTRYPOINT ["maintd"]
CMD ["--config", "/etc/maintd/maintd.toml", "run"]
