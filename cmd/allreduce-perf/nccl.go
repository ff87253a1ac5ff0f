package main

// The GPU backend: builds everywhere (it dlopens NCCL and the CUDA driver at run time) and
// reports clearly, at group creation, when either is missing.
import _ "github.com/goddp/goddp/backends/nccl"
