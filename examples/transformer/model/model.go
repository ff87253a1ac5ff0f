package model

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"

	"gorgonia.org/tensor"
)

// Tasks.
const (
	TaskMSE  = "mse"  // the seed's ddp_bench.py model: MSE against a random target
	TaskCopy = "copy" // embed random tokens, predict them back with cross-entropy
)

// ErrConfig is returned for an invalid Config or GraphOptions.
var ErrConfig = errors.New("model: invalid config")

// Config describes the model. DefaultConfig returns the seed's.
type Config struct {
	Task      string       // TaskMSE or TaskCopy ("" means TaskMSE)
	NumLayers int          // encoder layers
	Hidden    int          // d_model
	Heads     int          // attention heads (must divide Hidden)
	FF        int          // feed-forward width (0: 4·Hidden)
	Vocab     int          // TaskCopy vocabulary (0: 32)
	Dropout   float64      // dropout probability in [0, 1), applied when training
	Seed      uint64       // parameter initialisation
	DType     tensor.Dtype // tensor.Float32 (default) or tensor.Float64 (gradient checks)
}

// DefaultConfig is ddp_bench.py's: 2 layers, hidden 256, 8 heads, feed-forward 1024,
// dropout 0.1, float32.
func DefaultConfig() Config {
	return Config{Task: TaskMSE, NumLayers: 2, Hidden: 256, Heads: 8, Dropout: 0.1, DType: tensor.Float32}
}

func (c *Config) validate() error {
	if c.Task == "" {
		c.Task = TaskMSE
	}
	if c.FF == 0 {
		c.FF = 4 * c.Hidden
	}
	if c.Vocab == 0 {
		c.Vocab = 32
	}
	if c.DType == (tensor.Dtype{}) {
		c.DType = tensor.Float32
	}
	switch {
	case c.Task != TaskMSE && c.Task != TaskCopy:
		return fmt.Errorf("%w: task %q (want %q or %q)", ErrConfig, c.Task, TaskMSE, TaskCopy)
	case c.NumLayers < 0:
		return fmt.Errorf("%w: num_layers %d", ErrConfig, c.NumLayers)
	case c.Hidden <= 0 || c.Heads <= 0 || c.Hidden%c.Heads != 0:
		return fmt.Errorf("%w: hidden %d must be a positive multiple of heads %d", ErrConfig, c.Hidden, c.Heads)
	case c.FF <= 0 || c.Vocab <= 1:
		return fmt.Errorf("%w: ff %d, vocab %d", ErrConfig, c.FF, c.Vocab)
	case !(c.Dropout >= 0 && c.Dropout < 1):
		return fmt.Errorf("%w: dropout %v not in [0, 1)", ErrConfig, c.Dropout)
	case c.DType != tensor.Float32 && c.DType != tensor.Float64:
		return fmt.Errorf("%w: dtype %v (want float32 or float64)", ErrConfig, c.DType)
	}
	return nil
}

// Param describes one learnable: its PyTorch name, its shape here, and where it lives
// in the model's flat buffer.
//
// Linear weights are stored transposed relative to PyTorch ([in, out], so that
// y = x·W + b needs no transpose op) and biases and LayerNorm vectors as [1, n] rows;
// the element counts, and so the parameter count and bucket sizes, are PyTorch's.
type Param struct {
	Name   string
	Shape  []int
	Offset int // first element in the flat buffer
	Size   int // number of elements
}

// Model holds the learnables of the Transformer in one flat buffer, in registration
// order (PyTorch's model.parameters() order). It is not safe for concurrent use.
type Model struct {
	cfg    Config
	params []Param
	flat32 []float32 // when DType is Float32
	flat64 []float64 // when DType is Float64
}

// New builds the model and initialises its parameters deterministically from cfg.Seed
// (PyTorch's schemes: Linear U(±1/√in), in_proj Xavier-uniform with zero bias,
// out_proj zero bias, LayerNorm 1 and 0, embedding N(0,1)).
func New(cfg Config) (*Model, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	m := &Model{cfg: cfg}
	h, ff := cfg.Hidden, cfg.FF
	type init struct {
		kind  byte // 'u' uniform ±a, 'n' normal, '0' zeros, '1' ones
		bound float64
	}
	var inits []init
	add := func(name string, shape []int, in init) {
		n := 1
		for _, d := range shape {
			n *= d
		}
		off := 0
		if len(m.params) > 0 {
			last := m.params[len(m.params)-1]
			off = last.Offset + last.Size
		}
		m.params = append(m.params, Param{Name: name, Shape: shape, Offset: off, Size: n})
		inits = append(inits, in)
	}
	linear := func(prefix string, in, out int) {
		b := 1 / math.Sqrt(float64(in))
		add(prefix+"weight", []int{in, out}, init{'u', b})
		add(prefix+"bias", []int{1, out}, init{'u', b})
	}
	if cfg.Task == TaskCopy {
		add("0.weight", []int{cfg.Vocab, h}, init{'n', 1})
	} else {
		linear("0.", h, h)
	}
	for l := 0; l < cfg.NumLayers; l++ {
		p := fmt.Sprintf("1.layers.%d.", l)
		add(p+"self_attn.in_proj_weight", []int{h, 3 * h}, init{'u', math.Sqrt(6 / float64(h+3*h))})
		add(p+"self_attn.in_proj_bias", []int{1, 3 * h}, init{'0', 0})
		add(p+"self_attn.out_proj.weight", []int{h, h}, init{'u', 1 / math.Sqrt(float64(h))})
		add(p+"self_attn.out_proj.bias", []int{1, h}, init{'0', 0})
		linear(p+"linear1.", h, ff)
		linear(p+"linear2.", ff, h)
		add(p+"norm1.weight", []int{1, h}, init{'1', 0})
		add(p+"norm1.bias", []int{1, h}, init{'0', 0})
		add(p+"norm2.weight", []int{1, h}, init{'1', 0})
		add(p+"norm2.bias", []int{1, h}, init{'0', 0})
	}
	if cfg.Task == TaskCopy {
		linear("2.", h, cfg.Vocab)
	} else {
		linear("2.", h, h)
	}

	total := m.NumParams()
	vals := make([]float64, total)
	r := rand.New(rand.NewPCG(cfg.Seed, 0x5eed1417))
	for i, p := range m.params {
		v := vals[p.Offset : p.Offset+p.Size]
		for k := range v {
			switch inits[i].kind {
			case 'u':
				v[k] = (2*r.Float64() - 1) * inits[i].bound
			case 'n':
				v[k] = r.NormFloat64()
			case '1':
				v[k] = 1
			}
		}
	}
	if cfg.DType == tensor.Float64 {
		m.flat64 = vals
	} else {
		m.flat32 = make([]float32, total)
		for k, x := range vals {
			m.flat32[k] = float32(x)
		}
	}
	return m, nil
}

// Config returns the validated configuration (defaults filled in).
func (m *Model) Config() Config { return m.cfg }

// Params returns the learnables in registration order. The caller must not modify it.
func (m *Model) Params() []Param { return m.params }

// NumParams is the total number of learnable elements.
func (m *Model) NumParams() int {
	if len(m.params) == 0 {
		return 0
	}
	last := m.params[len(m.params)-1]
	return last.Offset + last.Size
}

// Data32 is the flat parameter buffer of a float32 model (nil for float64). Graphs read
// the parameters from it at every run: an optimizer updates the model in place here.
func (m *Model) Data32() []float32 { return m.flat32 }

// dense returns parameter i as a tensor backed by the flat buffer.
func (m *Model) dense(i int) *tensor.Dense {
	p := m.params[i]
	if m.flat64 != nil {
		return tensor.New(tensor.WithShape(p.Shape...), tensor.WithBacking(m.flat64[p.Offset:p.Offset+p.Size]))
	}
	return tensor.New(tensor.WithShape(p.Shape...), tensor.WithBacking(m.flat32[p.Offset:p.Offset+p.Size]))
}
