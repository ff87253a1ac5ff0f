package pgtest

import (
	"testing"

	"github.com/goddp/goddp/procgroup"
)

func newClusterGroups(t testing.TB, size int) []procgroup.ProcessGroup {
	c := NewCluster(size)
	t.Cleanup(c.Close)
	return c.Groups()
}

func TestConformanceCluster(t *testing.T) {
	Run(t, newClusterGroups, SuiteOptions{Short: testing.Short()})
}
