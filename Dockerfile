# maintd: slim, non-root image. Build: docker build -t maintd .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY maintd ./maintd
COPY migrations ./migrations
RUN python -m venv /opt/maintd && /opt/maintd/bin/pip install --no-cache-dir .

FROM python:3.11-slim
COPY --from=build /opt/maintd /opt/maintd
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin maintd
ENV PATH=/opt/maintd/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 9464
ENTRYPOINT ["maintd"]
CMD ["--config", "/etc/maintd/maintd.toml", "run"]
