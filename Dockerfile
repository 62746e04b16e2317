# relay's image, for KubeRay (deploy/kuberay/) or any Ray cluster whose nodes run containers.
#
#   docker build -t relay:latest .                                   # CPU torch (the default)
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t relay:cu128 .
#
# Two stages: the builder makes a venv at /opt/venv and installs relay into it (not editable);
# the runtime stage is the same slim Python with that venv copied in, relay's job configs under
# /app, and a non-root user `ray` (uid 1000, as in Ray's own images).

# Both stages use one base: the venv's python is a symlink to the base image's interpreter.
ARG PYTHON_IMAGE=python:3.11-slim-trixie

FROM ${PYTHON_IMAGE} AS builder
# Where torch comes from. PyTorch's CPU index by default: PyPI's Linux torch wheel is the CUDA
# build (several GB of CUDA libraries a CPU node never uses). torch==2.13.0 matches both
# 2.13.0+cpu from this index and 2.13.0 from PyPI; pip takes +cpu, the higher local version.
# For GPU nodes pass a CUDA index (https://download.pytorch.org/whl/cu128, ...) instead.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
# The heavy pins first (the same as pyproject.toml's; tests/test_kuberay.py checks that), in a
# layer of their own that survives edits to relay's code.
RUN pip install --extra-index-url "${TORCH_INDEX}" "torch==2.13.0" "ray[train,tune,serve]==2.60.0"
# README.md: pyproject.toml names it as the package's readme.
COPY pyproject.toml README.md ./
COPY platform ./platform
RUN pip install --extra-index-url "${TORCH_INDEX}" .

FROM ${PYTHON_IMAGE} AS runtime
# wget: KubeRay's readiness probe on RayService worker pods is an exec of `wget ... /-/healthz`.
# libcap2-bin: setcap, below. Debian's current versions: the base image pins the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget libcap2-bin \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 1000 ray \
    && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash ray
COPY --from=builder /opt/venv /opt/venv
# relay's hang doctor (relay/doctor/stacks.py) runs the py-spy beside the venv's python to dump
# the stacks of Train worker processes; py-spy attaches with ptrace. As uid 1000, the
# capability the pod adds (securityContext.capabilities.add: [SYS_PTRACE]) only bounds what a
# process may gain, it is not effective; this file capability makes py-spy gain it. A pod
# without SYS_PTRACE in its bounding set cannot exec this py-spy at all (EPERM).
RUN setcap cap_sys_ptrace+ep /opt/venv/bin/py-spy
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
WORKDIR /app
# The job configs the RayJobs name (relay train /app/jobs/configs/digits.yaml).
COPY jobs ./jobs
# Numeric, so that a pod's runAsNonRoot can check it. uid 1000 is the `ray` user made above.
USER 1000:1000
# `docker run relay:latest train jobs/configs/digits.yaml`. KubeRay sets the Ray containers' own
# command (bash -c "ray start ..."), which replaces this entrypoint there.
ENTRYPOINT ["relay"]
CMD ["--help"]
