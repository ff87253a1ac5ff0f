package procgroup_test

import (
	"context"
	"errors"
	"testing"

	"github.com/goddp/goddp/procgroup"
)

// TestUnknownBackend: asking for a backend that is not linked in (this test binary links
// gloo only) fails with ErrUnknownBackend and a message that names the import to add for
// goddp's own backends, and lists the known and the linked-in ones; New says the same.
func TestUnknownBackend(t *testing.T) {
	const known = "(known backends: gloo → github.com/goddp/goddp/backends/gloo, nccl → github.com/goddp/goddp/backends/nccl; linked in: gloo)"
	store := procgroup.NewMemStore()
	defer store.Close()
	for _, tc := range []struct{ name, want string }{
		{"nccl", `procgroup: unknown backend "nccl": not linked into this program; add import _ "github.com/goddp/goddp/backends/nccl" ` + known},
		{"mpi", `procgroup: unknown backend "mpi": no backend of that name exists ` + known},
	} {
		_, err := procgroup.Lookup(tc.name)
		if !errors.Is(err, procgroup.ErrUnknownBackend) || err.Error() != tc.want {
			t.Errorf("Lookup(%q):\n got %v\nwant %s", tc.name, err, tc.want)
		}
		_, err = procgroup.New(context.Background(), tc.name, procgroup.Options{Size: 1, Store: store})
		if !errors.Is(err, procgroup.ErrUnknownBackend) || err.Error() != tc.want {
			t.Errorf("New(%q):\n got %v\nwant %s", tc.name, err, tc.want)
		}
	}
	if _, err := procgroup.Lookup("gloo"); err != nil {
		t.Errorf("Lookup(gloo): %v", err)
	}
}
