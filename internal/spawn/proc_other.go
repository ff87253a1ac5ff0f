//go:build !linux

package spawn

import "os/exec"

// setDeathSignal: only Linux can tie a child's life to its parent's; elsewhere the ranks
// are killed by Local when it notices a failure or a signal.
func setDeathSignal(*exec.Cmd) {}
