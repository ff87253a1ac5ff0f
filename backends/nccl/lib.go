package nccl

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"unsafe"
)

// Environment variables that point the backend at its libraries.
const (
	// EnvNCCLLib is the path (or soname) of NCCL; default "libnccl.so.2".
	EnvNCCLLib = "GODDP_NCCL_LIB"
	// EnvCUDALib is the path (or soname) of the CUDA driver; default "libcuda.so.1".
	EnvCUDALib = "GODDP_CUDA_LIB"
)

const (
	defaultNCCLLib = "libnccl.so.2"
	defaultCUDALib = "libcuda.so.1"
)

// lib is one loaded pair of libraries. Loaded pairs are kept for the life of the process
// (the CUDA driver cannot be unloaded safely).
type lib struct {
	p                 *C.goddp_lib
	cudaPath          string
	ncclPath          string
	ncclVersion       int // NCCL_VERSION_CODE as ncclGetVersion reports it
	cudaDriverVersion int
}

var (
	libsMu sync.Mutex // guards libs
	libs   = map[[2]string]*lib{}
)

// loadLib opens (once per pair of paths) the CUDA driver and NCCL. A failed load is not
// cached, so that a later call may succeed once the library is installed.
func loadLib(cudaPath, ncclPath string) (*lib, error) {
	libsMu.Lock()
	defer libsMu.Unlock()
	key := [2]string{cudaPath, ncclPath}
	if l := libs[key]; l != nil {
		return l, nil
	}
	ccuda, cnccl := C.CString(cudaPath), C.CString(ncclPath)
	defer C.free(unsafe.Pointer(ccuda))
	defer C.free(unsafe.Pointer(cnccl))
	var errbuf [512]C.char
	var which C.int
	p := C.goddp_load(ccuda, cnccl, &errbuf[0], C.size_t(len(errbuf)), &which)
	if p == nil {
		msg := C.GoString(&errbuf[0])
		switch which {
		case 3:
			cudaMsg, ncclMsg, _ := strings.Cut(msg, "\n")
			return nil, fmt.Errorf("%w: cannot load NCCL %s from %q (%s) nor the CUDA driver %s from %q (%s); this machine needs an NVIDIA GPU with its driver and NCCL (for instance the nvidia-nccl-cu13 pip package), or set %s and %s to their paths",
				ErrUnavailable, defaultNCCLLib, ncclPath, ncclMsg, defaultCUDALib, cudaPath, cudaMsg, EnvNCCLLib, EnvCUDALib)
		case 1:
			return nil, fmt.Errorf("%w: cannot load the CUDA driver %s from %q (%s); install the NVIDIA driver or set %s to the path of libcuda.so.1",
				ErrUnavailable, defaultCUDALib, cudaPath, msg, EnvCUDALib)
		case 2:
			return nil, fmt.Errorf("%w: cannot load NCCL %s from %q (%s); install NCCL (for instance the nvidia-nccl-cu13 pip package) or set %s to the path of libnccl.so.2",
				ErrUnavailable, defaultNCCLLib, ncclPath, msg, EnvNCCLLib)
		}
		return nil, fmt.Errorf("%w: loading %s and %s: %s", ErrUnavailable, cudaPath, ncclPath, msg)
	}
	l := &lib{p: p, cudaPath: cudaPath, ncclPath: ncclPath}
	var v C.int
	if r := C.goddp_ncclGetVersion(p, &v); r != 0 {
		return nil, fmt.Errorf("%w: ncclGetVersion: %s", ErrUnavailable, C.GoString(C.goddp_nccl_error(p, r)))
	}
	l.ncclVersion = int(v)
	if r := C.goddp_cuDriverGetVersion(p, &v); r == 0 {
		l.cudaDriverVersion = int(v)
	}
	libs[key] = l
	return l, nil
}

// libPaths returns the library paths of cfg, else of the environment, else the sonames.
func libPaths(cfg *Config) (cudaPath, ncclPath string) {
	cudaPath, ncclPath = cfg.CUDALib, cfg.NCCLLib
	if cudaPath == "" {
		cudaPath = os.Getenv(EnvCUDALib)
	}
	if cudaPath == "" {
		cudaPath = defaultCUDALib
	}
	if ncclPath == "" {
		ncclPath = os.Getenv(EnvNCCLLib)
	}
	if ncclPath == "" {
		ncclPath = defaultNCCLLib
	}
	return cudaPath, ncclPath
}

// versionString formats NCCL_VERSION_CODE (X*10000+Y*100+Z since 2.9, X*1000+Y*100+Z before).
func versionString(code int) string {
	if code >= 10000 {
		return fmt.Sprintf("%d.%d.%d", code/10000, code%10000/100, code%100)
	}
	return fmt.Sprintf("%d.%d.%d", code/1000, code%1000/100, code%100)
}

// atLeast reports whether code is NCCL major.minor or later.
func atLeast(code, major, minor int) bool {
	if code < 10000 { // old encoding, before 2.9
		return major*1000+minor*100 <= code
	}
	return major*10000+minor*100 <= code
}

// cuErr formats a CUDA driver error.
func (l *lib) cuErr(step string, r C.goddp_CUresult) error {
	return fmt.Errorf("%s: %s (CUresult %d)", step, C.GoString(C.goddp_cu_error(l.p, r)), int(r))
}

// ncclErr formats an NCCL error.
func (l *lib) ncclErr(step string, r C.goddp_ncclResult_t) error {
	return fmt.Errorf("%s: %s (ncclResult %d)", step, C.GoString(C.goddp_nccl_error(l.p, r)), int(r))
}

// knob calls fake_knob(name, value) of the fake libraries of the tests; -1 if the loaded
// libraries do not export it (real ones do not).
func (l *lib) knob(name string, value int64) int64 {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	return int64(C.goddp_fake_knob(l.p, cname, C.longlong(value)))
}
