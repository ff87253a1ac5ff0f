// Package observe shows what a training run of package ddp does: a timeline per rank in the
// Chrome trace event format (Tracer, OpenTrace; Note [Trace format]), the
// communication/compute overlap of the backward passes (OverlapAccumulator), which rank the
// others wait for at the collectives (StragglerMonitor, AnalyzeArrivals), and a progress
// line (Progress). Each reads what the DDP measures anyway (DDP.Stats, after Finalize), so
// none costs anything on the hot path.
//
// It is a package of its own so that package ddp stays small; Prometheus metrics are in
// package metrics, and reading and merging trace files in package tracefile, which a tool
// such as ddprun imports alone.
package observe
