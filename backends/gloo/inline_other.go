//go:build !linux

package gloo

// Note [Inline exchange] (inline_linux.go) is Linux-only; elsewhere the two-rank socket
// all-reduce hands its sends to the peer's writer goroutine (pairAllReduce).

type inlineState struct{}

func (g *group) inlinePair() bool                { return false }
func (g *group) setSpins()                       {}
func (g *group) inlinePairAllReduce(o *op) error { panic("gloo: no inline exchange") }

func closeConn(p *peer) { p.conn.Close() }
