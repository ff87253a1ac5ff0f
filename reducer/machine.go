package reducer

import (
	"errors"
	"fmt"
	"strings"

	"github.com/goddp/goddp/bucket"
)

// Mode says whether a backward pass communicates.
type Mode int

const (
	// Sync: gradients are copied into their bucket slots (added to what earlier Accumulate
	// passes left there), buckets are all-reduced as they fill, and Finalize waits for them.
	Sync Mode = iota + 1
	// Accumulate: gradients are added up locally in their slots; nothing is communicated
	// (DDP's no_sync). The next Sync pass reduces the sum once.
	Accumulate
)

func (m Mode) String() string {
	switch m {
	case Sync:
		return "sync"
	case Accumulate:
		return "accumulate"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// Errors of the Machine (and so of the Reducer). Rich diagnostics are typed: see
// UnusedError. They are the reducer's own: procgroup.ErrInvalidArgument means a collective
// refused before it took a sequence number, and the watchdog counts on that.
var (
	// ErrUnusedParameters is wrapped by *UnusedError.
	ErrUnusedParameters = errors.New("reducer: parameters received no gradient")
	// ErrMarkedTwice: a parameter's gradient was reported ready twice in one backward.
	ErrMarkedTwice = errors.New("reducer: gradient marked ready twice")
	// ErrPhase: a call out of turn (GradReady outside a backward, Finalize twice, ...).
	ErrPhase = errors.New("reducer: call out of turn")
	// ErrInvalidArgument: a parameter index out of range, a gradient of the wrong type or
	// length, bad options.
	ErrInvalidArgument = errors.New("reducer: invalid argument")
	// ErrClosed: the Reducer was closed.
	ErrClosed = errors.New("reducer: closed")
)

// UnusedError names the parameters whose gradient never became ready in a synced backward
// run without Options.FindUnusedParameters, so that their buckets could not be reduced.
type UnusedError struct {
	Iter   int      // the backward pass, counted from 1 over every BeginBackward
	Params []int    // the parameters' indices, ascending
	Names  []string // their names, same order
}

// maxNamed bounds how many parameters an UnusedError's message lists.
const maxNamed = 20

func (e *UnusedError) Error() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "reducer: backward %d finished with %d parameter(s) that received no gradient, so their buckets were never reduced: ",
		e.Iter, len(e.Params))
	for k, i := range e.Params {
		if k == maxNamed {
			fmt.Fprintf(&sb, ", ... and %d more", len(e.Params)-maxNamed)
			break
		}
		if k > 0 {
			sb.WriteString(", ")
		}
		fmt.Fprintf(&sb, "%d (%s)", i, e.Names[k])
	}
	sb.WriteString("; if some parameters take no part in the loss, set Options.FindUnusedParameters")
	return sb.String()
}

// Unwrap makes errors.Is(err, ErrUnusedParameters) true.
func (e *UnusedError) Unwrap() error { return ErrUnusedParameters }

// ActionKind is what the driver must do for one Action.
type ActionKind int

const (
	// ActCopy: copy parameter Param's gradient, pre-divided by the world size, into its
	// bucket slot; with Add set, add it to what the slot holds instead.
	ActCopy ActionKind = iota + 1
	// ActZero: zero parameter Param's slot (an unused parameter contributes zeros).
	ActZero
	// ActLaunch: start the reduction of bucket Bucket (all its slots are filled).
	ActLaunch
	// ActUnpack: bucket Bucket is reduced; its slots hold the averaged gradients.
	ActUnpack
	// ActRebuild: every bucket of one of the first synced backwards (MachineConfig.Rebuilds)
	// is reduced; rebuild the buckets from the order Order reports (after agreeing on it
	// with the other ranks) and give them to SetBuckets.
	ActRebuild
	// ActDone: the iteration is finished.
	ActDone
)

func (k ActionKind) String() string {
	switch k {
	case ActCopy:
		return "copy"
	case ActZero:
		return "zero"
	case ActLaunch:
		return "launch"
	case ActUnpack:
		return "unpack"
	case ActRebuild:
		return "rebuild"
	case ActDone:
		return "done"
	}
	return fmt.Sprintf("ActionKind(%d)", int(k))
}

// Action is one step the driver performs, in the order given.
type Action struct {
	Kind   ActionKind
	Param  int  // ActCopy, ActZero
	Bucket int  // ActLaunch, ActUnpack; for ActCopy and ActZero, Param's bucket
	Add    bool // ActCopy: add into the slot rather than overwrite it
}

func (a Action) String() string {
	switch a.Kind {
	case ActCopy:
		if a.Add {
			return fmt.Sprintf("add p%d→b%d", a.Param, a.Bucket)
		}
		return fmt.Sprintf("copy p%d→b%d", a.Param, a.Bucket)
	case ActZero:
		return fmt.Sprintf("zero p%d", a.Param)
	case ActLaunch, ActUnpack:
		return fmt.Sprintf("%v b%d", a.Kind, a.Bucket)
	}
	return a.Kind.String()
}

// phase is where the Machine is in an iteration; no other field says it.
type phase int

const (
	phaseIdle       phase = iota // before the first backward, or after Finalize
	phaseSync                    // in a synced backward: slots fill, buckets launch
	phaseAccumulate              // in an accumulating backward: slots add up, nothing launches
	phaseFinalizing              // Finalize was called; waiting for BucketDone of every bucket
	phaseFailed                  // err ended the machine; every later event returns it
)

// MachineConfig configures a Machine.
type MachineConfig struct {
	// Params describe the parameters (names appear in errors).
	Params []bucket.Param
	// Buckets is the initial assignment (from bucket.Assign).
	Buckets []bucket.Bucket
	// FindUnusedParameters: at Finalize, parameters that got no gradient in a synced backward
	// contribute zeros (or what Accumulate passes left) instead of failing the iteration.
	FindUnusedParameters bool
	// Rebuilds asks for an ActRebuild after each of the first Rebuilds synced backwards
	// (the reducer asks for 1, or 3 with AutoBucketCap).
	Rebuilds int
}

// Machine is the reducer's scheduling logic: a synchronous state machine with no goroutines,
// clocks, channels or process group. Events come in as method calls; each returns the
// actions the driver must perform, in order, as a slice that stays valid until the next
// call. A Machine is not safe for concurrent use.
//
// Note [Bucket order]: every rank must issue its buckets' collectives in the same order or
// the ranks deadlock (procgroup Note [Collective order]). A bucket whose gradients are all
// ready launches only once every lower-index bucket has launched, so launches happen in
// index order on every rank, whatever order the gradients become ready in.
//
// Note [Accumulation window]: a slot's content belongs to the current window, which runs
// from one synced Finalize to the next. The first gradient a parameter gets in a window is
// copied into its slot; later ones (Accumulate passes, then the Sync pass) are added. So
// nothing is ever zeroed on the hot path, and a parameter unused in the Sync pass keeps what
// Accumulate passes left in its slot (zeroed only if the whole window left it empty).
type Machine struct {
	phase phase
	err   error // why phase is phaseFailed

	params     []bucket.Param
	lay        *bucket.Layout
	findUnused bool
	rebuilds   int // ActRebuilds still owed

	iter      int   // backward passes so far; the current one while in a backward
	window    int   // accumulation windows so far, counted from 1
	readyIter []int // per parameter: the iteration it was last marked ready in
	filledWin []int // per parameter: the window its slot last received data in
	pending   []int // per bucket: parameters not yet ready (synced backward)
	next      int   // the lowest bucket not launched yet
	done      int   // buckets reported done this iteration
	isDone    []bool
	order     []int // parameters in the order they became ready this backward
	nOrder    int
	unused    []int // FindUnusedParameters: the parameters that got no gradient, ascending
	out       []Action
}

// NewMachine checks cfg and returns an idle Machine.
func NewMachine(cfg MachineConfig) (*Machine, error) {
	lay, err := bucket.NewLayout(cfg.Params, cfg.Buckets)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidArgument, err)
	}
	n := len(cfg.Params)
	m := &Machine{
		params:     cfg.Params,
		findUnused: cfg.FindUnusedParameters,
		rebuilds:   cfg.Rebuilds,
		window:     1,
		readyIter:  make([]int, n),
		filledWin:  make([]int, n),
		order:      make([]int, n),
		unused:     make([]int, 0, n),
		out:        make([]Action, 0, 8),
	}
	m.setLayout(lay)
	return m, nil
}

func (m *Machine) setLayout(lay *bucket.Layout) {
	m.lay = lay
	nb := len(lay.Buckets)
	m.pending = make([]int, nb)
	m.isDone = make([]bool, nb)
	if cap(m.out) < nb+4 {
		m.out = make([]Action, 0, nb+4)
	}
}

// Layout is the current bucket layout.
func (m *Machine) Layout() *bucket.Layout { return m.lay }

// Iter is the number of backward passes begun so far.
func (m *Machine) Iter() int { return m.iter }

// Err is the error that failed the machine, or nil.
func (m *Machine) Err() error { return m.err }

// InBackward reports whether a backward pass has begun and Finalize has not been called.
func (m *Machine) InBackward() bool { return m.phase == phaseSync || m.phase == phaseAccumulate }

// Busy reports whether a synced pass is in progress (begun and not yet done).
func (m *Machine) Busy() bool { return m.phase == phaseSync || m.phase == phaseFinalizing }

// Accumulated reports whether a slot holds gradients of the current accumulation window
// (Accumulate passes since the last synced Finalize), which the next synced pass would
// add to.
func (m *Machine) Accumulated() bool {
	for _, w := range m.filledWin {
		if w == m.window {
			return true
		}
	}
	return false
}

// Unused lists the parameters that got no gradient in the last synced backward run with
// FindUnusedParameters (ascending). It is valid until the next BeginBackward.
func (m *Machine) Unused() []int { return m.unused }

// Fail ends the machine with err (for errors the driver finds, such as a failed
// collective). The first error counts.
func (m *Machine) Fail(err error) error {
	if m.phase != phaseFailed {
		m.phase, m.err = phaseFailed, err
	}
	return m.err
}

// BeginBackward starts a backward pass in mode. It fails if the previous synced pass was not
// finalized, naming the parameters that never became ready (an *UnusedError) when that is
// why; this failure, like every failure other than ErrPhase and ErrInvalidArgument for a
// bad mode, is sticky.
func (m *Machine) BeginBackward(mode Mode) error {
	if mode != Sync && mode != Accumulate {
		return fmt.Errorf("%w: mode %v", ErrInvalidArgument, mode)
	}
	switch m.phase {
	case phaseFailed:
		return m.err
	case phaseSync:
		if err := m.unusedError(); err != nil {
			return m.Fail(err)
		}
		return m.Fail(fmt.Errorf("%w: BeginBackward (backward %d): the previous synced backward was not finalized", ErrPhase, m.iter+1))
	case phaseFinalizing:
		return m.Fail(fmt.Errorf("%w: BeginBackward (backward %d): the previous Finalize did not complete", ErrPhase, m.iter+1))
	}
	// phaseIdle, or phaseAccumulate (an accumulating pass needs no Finalize).
	m.iter++
	m.nOrder = 0
	if mode == Accumulate {
		m.phase = phaseAccumulate
		return nil
	}
	for b := range m.lay.Buckets {
		m.pending[b] = len(m.lay.Buckets[b].Params)
		m.isDone[b] = false
	}
	m.next, m.done = 0, 0
	m.unused = m.unused[:0]
	m.phase = phaseSync
	return nil
}

// GradReady reports that parameter i's gradient is computed. The actions are an ActCopy
// for i, then ActLaunch for each bucket that may now launch (Note [Bucket order]).
// A gradient marked twice in one backward fails the machine with an error naming it.
func (m *Machine) GradReady(i int) ([]Action, error) {
	if m.phase == phaseFailed {
		return nil, m.err
	}
	if i < 0 || i >= len(m.params) {
		return nil, m.Fail(fmt.Errorf("%w: GradReady(%d): parameter index outside [0, %d)", ErrInvalidArgument, i, len(m.params)))
	}
	if !m.InBackward() {
		return nil, fmt.Errorf("%w: gradient of parameter %d (%s) reported outside a backward pass (call BeginBackward first)",
			ErrPhase, i, m.params[i].Name)
	}
	if m.readyIter[i] == m.iter {
		return nil, m.Fail(fmt.Errorf("%w: backward %d: parameter %d (%s) was reported ready twice; report a shared parameter once, after all its contributions are summed",
			ErrMarkedTwice, m.iter, i, m.params[i].Name))
	}
	m.readyIter[i] = m.iter
	m.order[m.nOrder] = i
	m.nOrder++
	b := m.lay.Where[i].Bucket
	m.out = append(m.out[:0], Action{Kind: ActCopy, Param: i, Bucket: b, Add: m.filledWin[i] == m.window})
	m.filledWin[i] = m.window
	if m.phase == phaseSync {
		m.pending[b]--
		m.launchReady()
	}
	return m.out, nil
}

// launchReady appends an ActLaunch for every bucket, in index order from m.next, that is
// complete and whose predecessors have all launched.
func (m *Machine) launchReady() {
	for m.next < len(m.pending) && m.pending[m.next] == 0 {
		m.out = append(m.out, Action{Kind: ActLaunch, Bucket: m.next})
		m.next++
	}
}

// Finalize ends the backward pass. After an accumulating pass it returns ActDone. After a
// synced pass it launches what is left: with FindUnusedParameters, parameters that got no
// gradient are zeroed (unless the window already filled them) and their buckets launched in
// order; without it, any such parameter fails the machine with an *UnusedError. The driver
// then waits for every launched bucket and reports each with BucketDone.
func (m *Machine) Finalize() ([]Action, error) {
	m.out = m.out[:0]
	switch m.phase {
	case phaseFailed:
		return nil, m.err
	case phaseAccumulate:
		m.phase = phaseIdle
		return append(m.out, Action{Kind: ActDone}), nil
	case phaseSync:
	default:
		return nil, fmt.Errorf("%w: Finalize without a backward pass in progress", ErrPhase)
	}
	if m.next < len(m.pending) {
		if !m.findUnused {
			return nil, m.Fail(m.unusedError())
		}
		for i := range m.params {
			if m.readyIter[i] == m.iter {
				continue
			}
			m.unused = append(m.unused, i)
			b := m.lay.Where[i].Bucket
			if m.filledWin[i] != m.window {
				m.out = append(m.out, Action{Kind: ActZero, Param: i, Bucket: b})
				m.filledWin[i] = m.window
			}
			m.pending[b]--
		}
		m.launchReady()
	}
	m.phase = phaseFinalizing
	return m.finishIfDone(), nil
}

// BucketDone reports that launched bucket b completed with err. A failure fails the
// machine. When the last bucket of a finalizing iteration is done, the actions end with an
// ActRebuild (if one is still owed) and ActDone.
func (m *Machine) BucketDone(b int, err error) ([]Action, error) {
	if m.phase == phaseFailed {
		return nil, m.err
	}
	if b < 0 || b >= m.next || m.isDone[b] {
		return nil, m.Fail(fmt.Errorf("%w: BucketDone(%d): bucket not launched, or already done (launched: %d)", ErrPhase, b, m.next))
	}
	if err != nil {
		return nil, m.Fail(fmt.Errorf("reducer: backward %d: bucket %d: %w", m.iter, b, err))
	}
	m.isDone[b] = true
	m.done++
	m.out = append(m.out[:0], Action{Kind: ActUnpack, Bucket: b})
	if m.phase == phaseFinalizing {
		return m.finishIfDone(), nil
	}
	return m.out, nil
}

// finishIfDone appends the end of the iteration to m.out once every bucket is done.
func (m *Machine) finishIfDone() []Action {
	if m.done < len(m.pending) {
		return m.out
	}
	m.phase = phaseIdle
	m.window++ // Note [Accumulation window]
	if m.rebuilds > 0 {
		m.rebuilds--
		m.out = append(m.out, Action{Kind: ActRebuild})
	}
	return append(m.out, Action{Kind: ActDone})
}

// SkipRebuilds drops the rebuilds still owed: the layout set now is final.
func (m *Machine) SkipRebuilds() { m.rebuilds = 0 }

// Order is the order for a rebuild: the parameters in the order they became ready in the
// current (or last) backward, followed by those that did not, in reverse registration
// order. The slice is the Machine's; it is valid until the next event.
func (m *Machine) Order() []int {
	n := m.nOrder
	if n < len(m.params) { // only with unused parameters: this allocates, once per rebuild
		mark := make([]bool, len(m.params))
		for _, i := range m.order[:n] {
			mark[i] = true
		}
		for i := len(m.params) - 1; i >= 0; i-- {
			if !mark[i] {
				m.order[n] = i
				n++
			}
		}
	}
	return m.order[:n]
}

// SetBuckets replaces the bucket layout, between iterations (after ActRebuild).
func (m *Machine) SetBuckets(buckets []bucket.Bucket) error {
	if m.phase != phaseIdle {
		return fmt.Errorf("%w: SetBuckets during an iteration", ErrPhase)
	}
	lay, err := bucket.NewLayout(m.params, buckets)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidArgument, err)
	}
	m.setLayout(lay)
	return nil
}

// Missing is an *UnusedError naming the parameters not reported in the current (or last)
// backward pass, Sync or Accumulate, or nil if every parameter was; it does not fail the
// machine. (A driver that gives each pass buffers of its own needs every pass complete.)
func (m *Machine) Missing() error {
	if m.nOrder == len(m.params) {
		return nil
	}
	return m.unusedError()
}

// unusedError names the parameters not ready in the current synced backward, or is nil.
func (m *Machine) unusedError() error {
	e := &UnusedError{Iter: m.iter}
	for i := range m.params {
		if m.readyIter[i] != m.iter {
			e.Params = append(e.Params, i)
			e.Names = append(e.Names, m.params[i].Name)
		}
	}
	if len(e.Params) == 0 {
		return nil
	}
	return e
}
