//go:build unix

package main

import (
	"runtime"
	"syscall"
	"time"
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

// processCPU is the CPU time, user and system, that every thread of the process has used.
func processCPU() (time.Duration, bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), true
}
