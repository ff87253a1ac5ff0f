package spawn

import (
	"os/exec"
	"syscall"
)

// setDeathSignal makes the kernel kill a rank if the launching command itself dies (even by
// SIGKILL), so that no rank is left behind.
func setDeathSignal(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
