//go:build !unix

package main

func peakRSS() (int64, bool) { return 0, false }
