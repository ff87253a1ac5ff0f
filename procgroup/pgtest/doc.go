// Package pgtest holds the test kit of the collective layer: Cluster, an in-memory world of
// ranks whose groups implement procgroup.ProcessGroup with fault injection, for unit tests of
// the layers above; and Run, the conformance suite every backend runs.
//
// # Usage
//
// A unit test of a higher layer runs one goroutine per rank on a Cluster:
//
//	c := pgtest.NewCluster(4)
//	defer c.Close()
//	c.SetDelay(3, time.Millisecond) // rank 3 is slow
//	err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
//		return trainOneStep(pg) // each rank issues the same collectives
//	})
//	recs := c.Issued(0) // what rank 0 issued, in order
//
// A backend runs the conformance suite from its own tests:
//
//	func TestConformance(t *testing.T) {
//		pgtest.Run(t, func(t testing.TB, size int) []procgroup.ProcessGroup {
//			return startLocalGroups(t, size)   // one group per rank, all in this process
//		}, pgtest.SuiteOptions{Short: testing.Short()})
//	}
package pgtest
