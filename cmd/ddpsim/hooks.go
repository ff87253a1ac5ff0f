package main

import (
	"errors"
	"fmt"
	"io"

	"github.com/goddp/goddp/bucket/sim"
)

// hookTable prints, for the layout of -first_cap_mb and -hooks_cap_mb, each hook's
// predicted step with every bucket under it, and the auto hook's choice bucket by bucket
// (Note [Hooks in the model] in package bucket/sim, Note [Auto hook] in package reducer).
func hookTable(w io.Writer, p *sim.Profile, c config) error {
	if p.Compression == nil {
		return errors.New("-hooks: the profile has no compression costs: write it from a run with --comm_hook auto --auto_profile FILE")
	}
	if err := p.Compression.Check(p); err != nil {
		return fmt.Errorf("-hooks: %w", err)
	}
	bs, err := p.Layout(mib(c.firstMB), mib(c.hooksCapMB))
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "\nhooks at first cap %g MB, cap %g MB (%d buckets):\n\n| hook | predicted ms/step | exposed ms | bytes per step on the wire |\n|---|---:|---:|---:|\n",
		c.firstMB, c.hooksCapMB, len(bs))
	row := func(name string, hooks []sim.Hook) error {
		costs := make([]sim.HookCost, len(bs))
		var wire int64
		for b, h := range hooks {
			if costs[b], err = p.Compression.Cost(p, bs[b], h); err != nil {
				return err
			}
			wire += costs[b].Wire
		}
		r, err := p.SimulateHooks(bs, costs)
		if err != nil {
			return err
		}
		fmt.Fprintf(w, "| %s | %.1f | %.1f | %d |\n", name, r.Step*1e3, r.Exposed*1e3, wire)
		return nil
	}
	uniform := func(h sim.Hook) []sim.Hook {
		hs := make([]sim.Hook, len(bs))
		for b := range hs {
			hs[b] = h
		}
		return hs
	}
	for _, h := range append(p.Compression.Candidates(), sim.Hook{Kind: "fp16"}) {
		if err := row(h.String(), uniform(h)); err != nil {
			return err
		}
	}
	plan, err := p.BestHooks(bs, sim.HookOptions{MinGain: sim.DefaultMinGain, Accuracy: sim.DefaultHookAccuracy, MinSaving: sim.DefaultHookMinSaving})
	if err != nil {
		return err
	}
	if err := row("auto: "+plan.Summary(), plan.Hooks); err != nil {
		return err
	}
	if plan.Kept {
		fmt.Fprintf(w, "\nauto keeps the plain all-reduce: the fastest set of hooks was predicted %.1f ms/step, not %g%% and %g ms faster than %.1f\n",
			plan.Fastest.Step*1e3, 100*sim.DefaultMinGain, 1e3*sim.DefaultHookMinSaving, plan.None.Step*1e3)
	}
	return nil
}
