package reducer

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/goddp/goddp/bucket"
	"github.com/goddp/goddp/procgroup/dtype"
)

// machineFor builds a Machine over params of the given lengths (float32), with buckets
// capped at capBytes (first bucket too).
func machineFor(t testing.TB, lens []int, capBytes int64, findUnused bool) *Machine {
	t.Helper()
	ps := make([]bucket.Param, len(lens))
	for i, n := range lens {
		ps[i] = bucket.Param{Name: fmt.Sprintf("p%d", i), DType: dtype.Float32, Len: n}
	}
	bs, err := bucket.Assign(ps, capBytes, capBytes)
	if err != nil {
		t.Fatal(err)
	}
	m, err := NewMachine(MachineConfig{Params: ps, Buckets: bs, FindUnusedParameters: findUnused, Rebuilds: 1})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func render(acts []Action) string {
	s := make([]string, len(acts))
	for k, a := range acts {
		s[k] = a.String()
	}
	return strings.Join(s, ", ")
}

// TestMachineScript drives a Machine through scripted events and compares every action
// list. Four params of 4 floats (16 B), cap 32 B: buckets b0 = {p3, p2}, b1 = {p1, p0}.
func TestMachineScript(t *testing.T) {
	type step struct {
		ev   string // "begin sync", "begin acc", "ready i", "finalize", "done b"
		want string
	}
	tests := []struct {
		name       string
		findUnused bool
		steps      []step
	}{
		{"in order", false, []step{
			{"begin sync", ""},
			{"ready 3", "copy p3→b0"},
			{"ready 2", "copy p2→b0, launch b0"},
			{"ready 1", "copy p1→b1"},
			{"done 0", "unpack b0"},
			{"ready 0", "copy p0→b1, launch b1"},
			{"finalize", ""},
			{"done 1", "unpack b1, rebuild, done"},
			{"begin sync", ""},
			{"ready 3", "copy p3→b0"},
		}},
		{"bucket 1 completes first and waits for bucket 0", false, []step{
			{"begin sync", ""},
			{"ready 0", "copy p0→b1"},
			{"ready 1", "copy p1→b1"},
			{"ready 3", "copy p3→b0"},
			{"ready 2", "copy p2→b0, launch b0, launch b1"},
			{"finalize", ""},
			{"done 0", "unpack b0"},
			{"done 1", "unpack b1, rebuild, done"},
		}},
		{"accumulate then sync adds; next window copies", false, []step{
			{"begin acc", ""},
			{"ready 2", "copy p2→b0"},
			{"ready 3", "copy p3→b0"},
			{"finalize", "done"},
			{"begin sync", ""},
			{"ready 3", "add p3→b0"},
			{"ready 2", "add p2→b0, launch b0"},
			{"ready 1", "copy p1→b1"},
			{"ready 0", "copy p0→b1, launch b1"},
			{"finalize", ""},
			{"done 0", "unpack b0"},
			{"done 1", "unpack b1, rebuild, done"},
			{"begin sync", ""},
			{"ready 2", "copy p2→b0"},
		}},
		{"unused parameters are zeroed and launched at finalize, in order", true, []step{
			{"begin acc", ""},
			{"ready 1", "copy p1→b1"},
			{"begin sync", ""}, // an accumulate pass needs no Finalize
			{"ready 3", "copy p3→b0"},
			{"finalize", "zero p0, zero p2, launch b0, launch b1"},
			{"done 0", "unpack b0"},
			{"done 1", "unpack b1, rebuild, done"},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := machineFor(t, []int{4, 4, 4, 4}, 32, tt.findUnused)
			if len(m.Layout().Buckets) != 2 {
				t.Fatalf("layout %+v", m.Layout().Buckets)
			}
			for _, st := range tt.steps {
				var acts []Action
				var err error
				var arg int
				switch {
				case st.ev == "begin sync":
					err = m.BeginBackward(Sync)
				case st.ev == "begin acc":
					err = m.BeginBackward(Accumulate)
				case st.ev == "finalize":
					acts, err = m.Finalize()
				case strings.HasPrefix(st.ev, "ready "):
					fmt.Sscan(st.ev[6:], &arg)
					acts, err = m.GradReady(arg)
				case strings.HasPrefix(st.ev, "done "):
					fmt.Sscan(st.ev[5:], &arg)
					acts, err = m.BucketDone(arg, nil)
				}
				if err != nil {
					t.Fatalf("%s: %v", st.ev, err)
				}
				if got := render(acts); got != st.want {
					t.Fatalf("%s: actions %q, want %q", st.ev, got, st.want)
				}
			}
		})
	}
}

func TestMachineUnusedError(t *testing.T) {
	const want = "reducer: backward 1 finished with 2 parameter(s) that received no gradient, so their buckets were never reduced: 0 (p0), 2 (p2); if some parameters take no part in the loss, set Options.FindUnusedParameters"
	// Reported by Finalize ...
	m := machineFor(t, []int{4, 4, 4, 4}, 32, false)
	_ = m.BeginBackward(Sync)
	m.GradReady(3)
	m.GradReady(1)
	_, err := m.Finalize()
	var ue *UnusedError
	if err == nil || err.Error() != want || !errors.As(err, &ue) || !errors.Is(err, ErrUnusedParameters) {
		t.Fatalf("Finalize: err = %v\nwant %s", err, want)
	}
	if fmt.Sprint(ue.Params) != "[0 2]" {
		t.Errorf("Params = %v", ue.Params)
	}
	if err2 := m.BeginBackward(Sync); err2 != err {
		t.Errorf("BeginBackward after failure: %v, want the same error", err2)
	}
	// ... and by the next BeginBackward when Finalize was never called.
	m = machineFor(t, []int{4, 4, 4, 4}, 32, false)
	_ = m.BeginBackward(Sync)
	m.GradReady(3)
	m.GradReady(1)
	if err := m.BeginBackward(Sync); err == nil || err.Error() != want {
		t.Fatalf("BeginBackward: err = %v\nwant %s", err, want)
	}
}

func TestMachineUnusedErrorTruncates(t *testing.T) {
	m := machineFor(t, make([]int, 30), 1<<10, false)
	_ = m.BeginBackward(Sync)
	_, err := m.Finalize()
	if err == nil || !strings.Contains(err.Error(), "19 (p19), ... and 10 more; if some") {
		t.Fatalf("err = %v", err)
	}
}

func TestMachineMarkedTwice(t *testing.T) {
	const want = "reducer: gradient marked ready twice: backward 1: parameter 2 (p2) was reported ready twice; report a shared parameter once, after all its contributions are summed"
	m := machineFor(t, []int{4, 4, 4, 4}, 32, false)
	_ = m.BeginBackward(Sync)
	m.GradReady(2)
	_, err := m.GradReady(2)
	if err == nil || err.Error() != want || !errors.Is(err, ErrMarkedTwice) {
		t.Fatalf("err = %v\nwant %s", err, want)
	}
	if _, err2 := m.Finalize(); err2 != err {
		t.Errorf("Finalize after failure: %v", err2)
	}
}

func TestMachineOutOfTurn(t *testing.T) {
	m := machineFor(t, []int{4, 4}, 32, false)
	if _, err := m.GradReady(0); !errors.Is(err, ErrPhase) {
		t.Fatalf("GradReady before BeginBackward: %v", err)
	}
	if _, err := m.Finalize(); !errors.Is(err, ErrPhase) {
		t.Fatalf("Finalize before BeginBackward: %v", err)
	}
	if err := m.BeginBackward(Mode(7)); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("bad mode: %v", err)
	}
	// None of these is sticky.
	if err := m.BeginBackward(Sync); err != nil {
		t.Fatal(err)
	}
	if _, err := m.GradReady(5); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("GradReady(5): %v", err)
	}
	if _, err := m.BucketDone(0, nil); err == nil { // sticky now
		t.Fatal("BucketDone after failure succeeded")
	}
}

func TestMachineBucketFailure(t *testing.T) {
	m := machineFor(t, []int{4}, 32, false)
	_ = m.BeginBackward(Sync)
	m.GradReady(0)
	m.Finalize()
	boom := errors.New("boom")
	if _, err := m.BucketDone(0, boom); !errors.Is(err, boom) || err.Error() != "reducer: backward 1: bucket 0: boom" {
		t.Fatalf("err = %v", err)
	}
}

// TestMachineOrderProperty: whatever order gradients become ready in, buckets launch in
// index order, each exactly once, never before all its parameters are ready; and the
// rebuild order is the observed one.
func TestMachineOrderProperty(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	for it := 0; it < 300; it++ {
		lens := make([]int, 1+rng.IntN(20))
		for i := range lens {
			lens[i] = 1 + rng.IntN(10)
		}
		m := machineFor(t, lens, int64(4+rng.IntN(80)), false)
		lay := m.Layout()
		if err := m.BeginBackward(Sync); err != nil {
			t.Fatal(err)
		}
		order := rng.Perm(len(lens))
		ready := make([]bool, len(lens))
		next := 0
		for _, i := range order {
			acts, err := m.GradReady(i)
			if err != nil {
				t.Fatal(err)
			}
			ready[i] = true
			if acts[0].Kind != ActCopy || acts[0].Param != i || acts[0].Add {
				t.Fatalf("first action %v", acts[0])
			}
			for _, a := range acts[1:] {
				if a.Kind != ActLaunch || a.Bucket != next {
					t.Fatalf("launched %v, want bucket %d", a, next)
				}
				for _, p := range lay.Buckets[a.Bucket].Params {
					if !ready[p] {
						t.Fatalf("bucket %d launched before parameter %d was ready", a.Bucket, p)
					}
				}
				next++
			}
		}
		if next != len(lay.Buckets) {
			t.Fatalf("launched %d of %d buckets", next, len(lay.Buckets))
		}
		if fmt.Sprint(m.Order()) != fmt.Sprint(order) {
			t.Fatalf("Order %v, want %v", m.Order(), order)
		}
	}
}
