package gloo

import (
	"fmt"

	"github.com/goddp/goddp/procgroup"
)

// PeerLostError reports a peer whose connection closed or broke. It wraps
// procgroup.ErrPeerLost (errors.Is) and the underlying I/O error.
type PeerLostError struct {
	Rank     int    // the lost peer
	Host     string // its host name, when known
	Reporter int    // the rank that saw the loss (this rank, or the peer that told us)
	Err      error  // the I/O error or the reporter's reason
}

func (e *PeerLostError) Error() string {
	host := ""
	if e.Host != "" {
		host = " on " + e.Host
	}
	return fmt.Sprintf("peer rank %d%s lost (seen by rank %d): %v", e.Rank, host, e.Reporter, e.Err)
}

// Unwrap makes errors.Is(err, procgroup.ErrPeerLost) true.
func (e *PeerLostError) Unwrap() []error { return []error{procgroup.ErrPeerLost, e.Err} }
