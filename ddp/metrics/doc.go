// Package metrics exports a rank's training metrics to Prometheus: step time, loss, bytes
// reduced, the latency of each bucket's collective, the exposed communication and the
// restarts (Recorder), served over HTTP (Serve).
//
// It is a package of its own so that package ddp links no Prometheus client:
//
//	rec, err := metrics.New(metrics.Options{Rank: d.Rank(), GoCollectors: true})
//	srv, err := metrics.Serve(":9400", rec)
//	defer srv.Close(ctx)
//	for step := ... {
//		... d.Finalize(ctx) ...
//		rec.ObserveStats(d.Stats())
//		rec.ObserveStep(time.Since(t0), loss)
//	}
package metrics
