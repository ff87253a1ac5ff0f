//go:build !unix

package main

import "time"

func peakRSS() (int64, bool) { return 0, false }

func processCPU() (time.Duration, bool) { return 0, false }
