# The trainer image: examples/transformer (and ddprun) on Debian, its matrix products on
# goddp's Go-assembly SGEMM (or on OpenBLAS, with TAGS=openblas).
#
#   docker build -t goddp/transformer .
#   docker build --build-arg TAGS=openblas -t goddp/transformer:openblas .
#
# The image runs one rank; the launcher (Kubernetes with the manifests in deploy/k8s/,
# torchrun, srun, mpirun) says which one through the environment.
FROM golang:1.26-bookworm AS build
ARG TAGS=
RUN apt-get update && apt-get install -y --no-install-recommends libopenblas-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN go build -tags "$TAGS" -o /out/transformer ./examples/transformer && \
    go build -o /out/ddprun ./cmd/ddprun

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends libopenblas0-pthread ca-certificates && \
    rm -rf /var/lib/apt/lists/*
COPY --from=build /out/transformer /out/ddprun /usr/local/bin/
# One BLAS thread per rank (ddp_bench.py's setting); see the README on OPENBLAS_CORETYPE.
ENV OPENBLAS_NUM_THREADS=1
# Checkpoints go here; mount a volume to keep them across pod restarts.
VOLUME /ckpt
ENTRYPOINT ["/usr/local/bin/transformer"]
