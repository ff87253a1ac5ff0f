package main

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/goddp/goddp/examples/transformer/optim"
)

// Checkpoint file: magic, version, step, n (uint64 each, little endian), then the n
// parameters, the optimizer's step count and its n first and n second moments
// (float32 little endian), then a CRC-32 of everything before it.
const ckptMagic = 0x74706b63_70646467 // "gddpckpt"

// saveCheckpoint writes atomically (temporary file, fsync, rename).
func saveCheckpoint(path string, step int, params []float32, opt *optim.AdamW) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".ckpt-*")
	if err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	defer os.Remove(tmp.Name()) // no-op after the rename
	optStep, m, v := opt.State()
	bw := bufio.NewWriter(tmp)
	crc := newCRCWriter(bw)
	hdr := []uint64{ckptMagic, 1, uint64(step), uint64(len(params)), uint64(optStep)}
	for _, x := range [][]any{{hdr}, {params}, {m}, {v}} {
		if err := binary.Write(crc, binary.LittleEndian, x[0]); err != nil {
			tmp.Close()
			return fmt.Errorf("checkpoint %s: %w", path, err)
		}
	}
	if err := binary.Write(bw, binary.LittleEndian, crc.sum()); err != nil {
		tmp.Close()
		return fmt.Errorf("checkpoint %s: %w", path, err)
	}
	if err := errors.Join(bw.Flush(), tmp.Sync(), tmp.Close()); err != nil {
		return fmt.Errorf("checkpoint %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	return nil
}

// loadCheckpoint restores params and opt; it returns the step to continue from, or
// an error wrapping os.ErrNotExist when there is no checkpoint.
func loadCheckpoint(path string, params []float32, opt *optim.AdamW) (int, error) {
	fh, err := os.Open(path)
	if err != nil {
		return 0, fmt.Errorf("checkpoint: %w", err)
	}
	defer fh.Close()
	crc := newCRCReader(bufio.NewReader(fh))
	hdr := make([]uint64, 5)
	if err := binary.Read(crc, binary.LittleEndian, hdr); err != nil {
		return 0, fmt.Errorf("checkpoint %s: header: %w", path, err)
	}
	if hdr[0] != ckptMagic || hdr[1] != 1 {
		return 0, fmt.Errorf("checkpoint %s: not a version-1 checkpoint", path)
	}
	if hdr[3] != uint64(len(params)) {
		return 0, fmt.Errorf("checkpoint %s: %d parameters, model has %d", path, hdr[3], len(params))
	}
	p := make([]float32, len(params))
	m := make([]float32, len(params))
	v := make([]float32, len(params))
	for _, x := range [][]float32{p, m, v} {
		if err := binary.Read(crc, binary.LittleEndian, x); err != nil {
			return 0, fmt.Errorf("checkpoint %s: %w", path, err)
		}
	}
	want := crc.sum()
	var got uint32
	if err := binary.Read(crc.r, binary.LittleEndian, &got); err != nil || got != want {
		return 0, fmt.Errorf("checkpoint %s: corrupt (crc %08x, want %08x, %v)", path, got, want, err)
	}
	if err := opt.SetState(int(hdr[4]), m, v); err != nil {
		return 0, fmt.Errorf("checkpoint %s: %w", path, err)
	}
	copy(params, p)
	return int(hdr[2]), nil
}

type crcWriter struct {
	w   io.Writer
	crc uint32
}

func newCRCWriter(w io.Writer) *crcWriter { return &crcWriter{w: w} }
func (c *crcWriter) Write(b []byte) (int, error) {
	c.crc = crc32Update(c.crc, b)
	return c.w.Write(b)
}
func (c *crcWriter) sum() uint32 { return c.crc }

type crcReader struct {
	r   io.Reader
	crc uint32
}

func newCRCReader(r io.Reader) *crcReader { return &crcReader{r: r} }
func (c *crcReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.crc = crc32Update(c.crc, b[:n])
	return n, err
}
func (c *crcReader) sum() uint32 { return c.crc }
