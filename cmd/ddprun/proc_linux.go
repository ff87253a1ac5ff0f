package main

import (
	"errors"
	"syscall"

	"golang.org/x/sys/unix"
)

// rankSysProcAttr puts a rank in its own process group (so ddprun can signal it and
// everything it started as one, and a terminal's Ctrl-C reaches only ddprun, which then stops
// the ranks in order) and has the kernel SIGKILL it if ddprun dies.
//
// Pdeathsig fires when the thread that forked the child exits, not the process. The Go
// runtime only ends a thread when a goroutine exits while locked to it (runtime.LockOSThread),
// which ddprun never does, so in practice it fires exactly when ddprun dies. The runtime also
// checks, after setting it, whether the parent already died during the fork.
func rankSysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}

// waitExited blocks until process pid has exited, without reaping it. While the exited
// process is an unreaped zombie its pid, and so its process group id, cannot be reused, which
// makes it safe to signal the group afterwards (Note [Reaping]).
func waitExited(pid int) error {
	for {
		var info unix.Siginfo
		err := unix.Waitid(unix.P_PID, pid, &info, unix.WEXITED|unix.WNOWAIT, nil)
		if !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}

// signalGroup sends sig to the process group pgid.
func signalGroup(pgid int, sig syscall.Signal) error {
	return syscall.Kill(-pgid, sig)
}
