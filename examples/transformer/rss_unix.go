//go:build unix

package main

import (
	"runtime"
	"syscall"
)

// peakRSS is the process's peak resident set size in bytes (getrusage's ru_maxrss).
func peakRSS() (int64, bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	if runtime.GOOS == "darwin" || runtime.GOOS == "ios" {
		return ru.Maxrss, true // bytes there
	}
	return ru.Maxrss * 1024, true // KiB on Linux and the BSDs
}
