//go:build !cgo

package nccl

import (
	"context"
	"fmt"

	"github.com/goddp/goddp/procgroup"
)

// Without cgo the backend cannot load NCCL; it still registers, so that asking for it
// gives this reason rather than "unknown backend".
func init() {
	procgroup.Register("nccl", func(ctx context.Context, opts procgroup.Options) (procgroup.ProcessGroup, error) {
		return nil, fmt.Errorf("rank %d: %w: this binary was built without cgo (CGO_ENABLED=0); rebuild with cgo and a C compiler to load libnccl.so.2", opts.Rank, ErrUnavailable)
	})
}
