# The eaglegen image the compose services run (workers, Flower, exporter, simulator).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY core core
COPY eaglegen eaglegen
COPY exporter exporter
COPY models models
COPY producer producer
COPY worker worker
RUN pip install --no-cache-dir . \
    && useradd --create-home eaglegen
USER eaglegen
ENV EAGLEGEN_DATA_DIR=/home/eaglegen/.eaglegen
CMD ["eaglegen", "--help"]
