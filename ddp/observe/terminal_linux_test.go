package observe

import (
	"fmt"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// openPTY opens a pseudo-terminal pair and returns its terminal side.
func openPTY(t *testing.T) *os.File {
	t.Helper()
	master, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("no pseudo-terminals here: %v", err)
	}
	t.Cleanup(func() { master.Close() })
	if err := unix.IoctlSetPointerInt(int(master.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(master.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	tty, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tty.Close() })
	return tty
}

// A terminal is the user's, except the pseudo-terminal that mpirun gives its ranks; a
// pipe never is.
func TestIsUserTerminal(t *testing.T) {
	tty := openPTY(t)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	env := func(kv ...string) func(string) (string, bool) {
		return func(k string) (string, bool) {
			for i := 0; i < len(kv); i += 2 {
				if kv[i] == k {
					return kv[i+1], true
				}
			}
			return "", false
		}
	}
	for _, c := range []struct {
		name string
		w    *os.File
		env  func(string) (string, bool)
		want bool
	}{
		{"terminal", tty, env(), true},
		{"terminal under torchrun", tty, env("RANK", "0", "TORCHELASTIC_RUN_ID", "x"), true},
		{"mpirun's pseudo-terminal", tty, env("OMPI_COMM_WORLD_RANK", "0"), false},
		{"PMIx rank", tty, env("PMIX_RANK", "1"), false},
		{"pipe", w, env(), false},
	} {
		if got := IsUserTerminal(c.w, c.env); got != c.want {
			t.Errorf("%s: IsUserTerminal = %v, want %v", c.name, got, c.want)
		}
	}
}
