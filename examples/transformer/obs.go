package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/metrics"
	"github.com/goddp/goddp/ddp/observe"
)

// observer is what the trainer shows of a run besides its result: the timeline
// (--trace, or GODDP_TRACE from ddprun --trace_merge), the overlap report every
// --report_every steps and at the end, the straggler report at the end, the Prometheus
// metrics (--metrics_addr) and the progress display. A part that is off costs nothing: the
// Tracer, Recorder and Progress are nil then, and their methods return at once.
type observer struct {
	rank  int
	every int
	total int

	tr        *observe.Tracer
	traceFile io.Closer                   // the --no_ddp trace's file, closed after tr
	acc       *observe.OverlapAccumulator // nil without ddp
	sm        *observe.StragglerMonitor   // nil without ddp
	m         *metrics.Recorder
	srv       *metrics.Server

	out  io.Writer         // rank 0's stdout; nil on the other ranks
	prog *observe.Progress // rank 0 on a terminal: one line redrawn in place

	// The plain progress lines (not a terminal): the mean ms/step since the previous line,
	// and the ETA from the mean since the first step of this attempt.
	firstStep, lastStep int
	firstT, lastT       time.Time
}

// newObserver sets up what the flags ask for. d is nil without ddp. Call close when done,
// whatever happens.
func newObserver(f flags, w world, d *ddp.DDP, stdout io.Writer, total int) (o *observer, err error) {
	o = &observer{rank: w.rank, every: max(f.reportEvery, 1), total: total, firstStep: -1}
	defer func() {
		if err != nil {
			o.close(context.Background())
		}
	}()
	if w.rank == 0 {
		o.out = stdout
		if observe.IsUserTerminal(stdout, nil) {
			o.prog = observe.NewProgress(stdout, observe.ProgressOptions{Total: total, Mode: observe.ProgressTerminal})
		}
	}
	if o.tr, o.traceFile, err = openTrace(f, d); err != nil {
		return o, err
	}
	if d != nil {
		o.acc = observe.NewOverlapAccumulator(d)
		// The straggler data is exchanged every --report_every steps, a collective that
		// ranks with uneven steps (--steps_per_rank) would not all reach.
		if f.stepsPerRank == nil {
			if o.sm, err = observe.NewStragglerMonitor(d, o.every); err != nil {
				return o, err
			}
		}
	}
	if f.metricsAddr != "" {
		if o.m, err = metrics.New(metrics.Options{Rank: w.rank, Getenv: f.getenv, GoCollectors: true}); err != nil {
			return o, fmt.Errorf("rank %d: %w", w.rank, err)
		}
		addr, err := rankAddr(f.metricsAddr, localRank(f, w))
		if err != nil {
			return o, fmt.Errorf("rank %d: --metrics_addr: %w", w.rank, err)
		}
		if o.srv, err = metrics.Serve(addr, o.m); err != nil {
			return o, fmt.Errorf("rank %d: --metrics_addr: %w", w.rank, err)
		}
		fmt.Fprintf(stdout, "rank %d metrics on http://%s/metrics\n", w.rank, o.srv.Addr())
		if f.onServe != nil {
			f.onServe(o.srv.Addr())
		}
	}
	return o, nil
}

// openTrace opens the timeline: with ddp through observe.OpenTrace (which falls back to
// GODDP_TRACE); without, a trace of the trainer's own spans on rank 0's track.
// The file of the latter is returned to close after the Tracer (OpenTrace's Tracer closes
// its own).
func openTrace(f flags, d *ddp.DDP) (*observe.Tracer, io.Closer, error) {
	if d != nil {
		tr, err := observe.OpenTrace(f.trace, d)
		return tr, nil, err
	}
	path := f.trace
	if path == "" {
		path = f.getenv(observe.TraceEnvVar)
	}
	if path == "" {
		return nil, nil, nil
	}
	path = observe.TracePath(path, 0, 1)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, nil, fmt.Errorf("trace: %w", err)
	}
	fh, err := os.Create(path)
	if err != nil {
		return nil, nil, fmt.Errorf("trace: %w", err)
	}
	tr, err := observe.NewTracer(fh, observe.TraceOptions{Rank: 0, WorldSize: 1})
	if err != nil {
		fh.Close()
		return nil, nil, err
	}
	return tr, fh, nil
}

// localRank is this process's rank on its host (LOCAL_RANK, as ddprun sets it), or its
// global rank when the launcher did not say.
func localRank(f flags, w world) int {
	if n, err := strconv.Atoi(f.getenv("LOCAL_RANK")); err == nil && n >= 0 {
		return n
	}
	return w.rank
}

// rankAddr is addr with its port moved up by localRank, so that the ranks of one host, which
// share a command line, listen on consecutive ports (port 0 stays 0: any free port).
func rankAddr(addr string, localRank int) (string, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", err
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 0 || p+localRank > 65535 {
		return "", fmt.Errorf("port %q: want a number in [0, 65535-local rank]", port)
	}
	if p != 0 {
		p += localRank
	}
	return net.JoinHostPort(host, strconv.Itoa(p)), nil
}

// afterFinalize records a synced step's reducer measurements.
func (o *observer) afterFinalize(ctx context.Context, d *ddp.DDP) error {
	if d == nil {
		return nil
	}
	st := d.Stats()
	o.tr.Record(st)
	o.acc.Add(st)
	o.m.ObserveStats(st)
	if o.sm == nil {
		return nil
	}
	return o.sm.Record(ctx, st)
}

// endStep records a step's wall time and this rank's loss, and prints the overlap report
// every --report_every steps (rank 0).
func (o *observer) endStep(step int, dur time.Duration, loss float64) {
	o.m.ObserveStep(dur, loss)
	if o.acc == nil {
		return
	}
	o.acc.AddStep(dur)
	if o.out != nil && (step+1)%o.every == 0 {
		o.println(o.acc.Report().String())
		o.acc.Reset()
	}
}

// showLoss shows the global batch's loss after step (rank 0): the progress line on a
// terminal, otherwise "step N loss L" with the ms/step since the previous line and the ETA.
func (o *observer) showLoss(step int, loss float64) {
	if o.out == nil {
		return
	}
	if o.prog != nil {
		o.prog.Update(step, loss)
		return
	}
	now := time.Now()
	line := fmt.Sprintf("step %d loss %.6f", step, loss)
	if o.firstStep < 0 {
		o.firstStep, o.firstT = step, now
	} else if n := step - o.lastStep; n > 0 {
		per := now.Sub(o.lastT) / time.Duration(n)
		eta := now.Sub(o.firstT) / time.Duration(step-o.firstStep) * time.Duration(o.total-1-step)
		line += fmt.Sprintf("  %.1f ms/step  ETA %s", float64(per)/1e6, eta.Round(time.Second))
	}
	o.lastStep, o.lastT = step, now
	fmt.Fprintln(o.out, line)
}

// println writes a line of rank 0's output, first clearing the progress line on a terminal.
func (o *observer) println(s string) {
	if o.out == nil {
		return
	}
	if o.prog != nil {
		fmt.Fprint(o.out, "\r\x1b[K")
	}
	fmt.Fprintln(o.out, s)
}

// finish ends the progress display, exchanges the last straggler data (every rank: it is a
// collective) and prints the last overlap window and the straggler report (rank 0).
func (o *observer) finish(ctx context.Context) error {
	if o.prog != nil {
		o.prog.Done()
	}
	if o.acc == nil {
		return nil
	}
	if o.sm != nil {
		if err := o.sm.Flush(ctx); err != nil {
			return err
		}
	}
	if o.out != nil {
		if r := o.acc.Report(); r.Passes > 0 {
			o.println(r.String())
		}
		if o.sm != nil {
			o.println(o.sm.Report().String())
		}
	}
	return nil
}

// close ends the trace and stops the metrics server.
func (o *observer) close(ctx context.Context) error {
	var errs []error
	errs = append(errs, o.tr.Close())
	if o.traceFile != nil {
		errs = append(errs, o.traceFile.Close())
	}
	if o.srv != nil {
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		errs = append(errs, o.srv.Close(ctx))
	}
	return errors.Join(errs...)
}
