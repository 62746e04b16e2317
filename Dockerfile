# relay's image, for KubeRay (deploy/kuberay/) or any Ray cluster whose nodes run containers.
#
#   docker build -t relay:latest .                                   # CPU torch (the default)
#   docker build --target debug -t relay-debug:latest .              # + the hang doctor's ptrace
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t relay:cu128 .
#
# Stages: the builder makes a venv at /opt/venv and installs relay into it (not editable); base is
# the same slim Python with that venv copied in, relay's job configs under /app, and a non-root
# user `ray` (uid 1000, as in Ray's own images); debug adds py-spy's ptrace file capability
# (deploy/kuberay/debug/); runtime, the last stage and so what a plain build makes, is base
# with nothing added.
#
# Where packages come from: torch alone from PyTorch's index (`--index-url`, `--no-deps`: no
# other name is ever looked up there), everything else from PyPI at the exact versions of
# deploy/kuberay/image-constraints.txt (the versions the tests ran against; regenerate it with
# deploy/kuberay/make_constraints.py). An `--extra-index-url` would let either index serve any
# package, whichever offers the higher version.

# Both stages use one base: the venv's python is a symlink to the base image's interpreter.
ARG PYTHON_IMAGE=python:3.11-slim-trixie

FROM ${PYTHON_IMAGE} AS builder
# Where torch comes from. PyTorch's CPU index by default: PyPI's Linux torch wheel is the CUDA
# build (several GB of CUDA libraries a CPU node never uses). torch==2.13.0 matches 2.13.0+cpu
# there. For GPU nodes pass a CUDA index (https://download.pytorch.org/whl/cu128, ...) instead;
# its CUDA libraries (nvidia-*) then come from PyPI, not pinned by the constraints file.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# PIP_CONSTRAINT: the same pins for pip's isolated build environment (setuptools, to build
# relay), which the command-line --constraint does not reach.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CONSTRAINT=/src/image-constraints.txt \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
COPY deploy/kuberay/image-constraints.txt ./image-constraints.txt
# torch alone, from its index; its own requirements (filelock, sympy, ...) come with the next
# step, from PyPI and pinned.
RUN pip install --no-deps --index-url "${TORCH_INDEX}" "torch==2.13.0"
# The heavy pins first (the same as pyproject.toml's; tests/test_kuberay.py checks that), in a
# layer of their own that survives edits to relay's code (and apart from torch's, the bigger).
# hadolint ignore=DL3059
RUN pip install --constraint image-constraints.txt "ray[train,tune,serve]==2.60.0"
# README.md: pyproject.toml names it as the package's readme.
COPY pyproject.toml README.md ./
COPY platform ./platform
# pip check: every installed distribution's requirements hold (torch's included).
RUN pip install --constraint image-constraints.txt . && pip check

FROM ${PYTHON_IMAGE} AS base
# wget: KubeRay's readiness probe on RayService worker pods is an exec of `wget ... /-/healthz`.
# Debian's current version: the base image pins the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 1000 ray \
    && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash ray
COPY --from=builder /opt/venv /opt/venv
# MPLCONFIGDIR: the pods' root filesystem is read-only (the home directory too); /tmp is theirs.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    MPLCONFIGDIR=/tmp/matplotlib
WORKDIR /app
# The job configs the RayJobs name (relay train /app/jobs/configs/digits.yaml).
COPY jobs ./jobs
# Numeric, so that a pod's runAsNonRoot can check it. uid 1000 is the `ray` user made above.
USER 1000:1000
# `docker run relay:latest train jobs/configs/digits.yaml`. KubeRay sets the Ray containers' own
# command (bash -c "ray start ..."), which replaces this entrypoint there.
ENTRYPOINT ["relay"]
CMD ["--help"]

FROM base AS debug
# relay's hang doctor (relay/observe/doctor/stacks.py) runs the py-spy beside the venv's python to dump
# the stacks of Train worker processes; py-spy attaches with ptrace. As uid 1000, the
# capability a pod adds (securityContext.capabilities.add: [SYS_PTRACE]) only bounds what a
# process may gain, it is not effective; this file capability makes py-spy gain it. A pod
# without SYS_PTRACE in its bounding set cannot exec this py-spy at all (EPERM), which is why
# only this target has it: the default image runs under Pod Security "restricted".
USER 0
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libcap2-bin \
    && rm -rf /var/lib/apt/lists/* \
    && setcap cap_sys_ptrace+ep /opt/venv/bin/py-spy
USER 1000:1000

# The default target: base as it is, py-spy without capabilities.
FROM base AS runtime
