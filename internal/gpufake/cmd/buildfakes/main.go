// Command buildfakes compiles the fake libcuda.so.1, libnccl.so.2 and libcublas.so of the
// tests into a directory (scripts/gpu_check.sh selftest): buildfakes DIR.
package main

import (
	"fmt"
	"os"

	"github.com/goddp/goddp/internal/gpufake"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: buildfakes DIR")
		os.Exit(2)
	}
	if err := os.MkdirAll(os.Args[1], 0o755); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	l, err := gpufake.Build(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println("fakes:", l.CUDA, l.NCCL, l.CUBLAS)
}
