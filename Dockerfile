# kvpubd in a container. Build:   docker build -t kvpubd .
# With CuPy for cache.device = "cuda:N" (CUDA 12 driver on the host; run with --gpus):
#                                 docker build --build-arg GPU=1 -t kvpubd:gpu .
# Run (the pool is POSIX shared memory: give /dev/shm room for every rank's pool):
#   docker run --shm-size=256m -p 5557:5557 -p 5657:5657 kvpubd
# Configure with KVPUBD_<SECTION>__<KEY> variables (-e) or a mounted file
# (-v ./kvpubd.toml:/etc/kvpubd/kvpubd.toml:ro).

FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvpubd ./kvpubd
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.12-slim
ARG GPU=""
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVPUBD_CONTROL__ENDPOINT=ipc:///run/kvpubd/control.sock \
    KVPUBD_EVENTS__SEQ_STATE_DIR=/var/lib/kvpubd
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/kvpubd-*.whl \
    && rm -rf /wheels \
    && groupadd --system --gid 10001 kvpubd \
    && useradd --system --uid 10001 --gid kvpubd --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin kvpubd \
    && install -d -o kvpubd -g kvpubd -m 0700 /run/kvpubd /var/lib/kvpubd
# GPU: CuPy (the "gpu" extra) plus the CUDA runtime and NVRTC from PyPI; the host's driver
# is mounted by the NVIDIA container toolkit.
RUN if [ -n "$GPU" ]; then \
        pip install --no-cache-dir "cupy-cuda12x>=13" "cuda-toolkit[cudart,nvrtc]==12.*"; \
    fi
COPY config/kvpubd.toml /etc/kvpubd/kvpubd.toml
USER 10001:10001
# The seq state files: a volume, so that a new container continues the last one's seqs.
VOLUME /var/lib/kvpubd
# PUB and replay ports of rank 0 (rank r uses port + r).
EXPOSE 5557 5657
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["kvpubd", "ping", "--control", "ipc:///run/kvpubd/control.sock", "--timeout", "3"]
ENTRYPOINT ["kvpubd"]
CMD ["serve", "--config", "/etc/kvpubd/kvpubd.toml"]
