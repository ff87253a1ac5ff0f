package checkpoint

import (
	"bytes"
	"encoding/binary"
	"hash/crc32"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const fuzzPath = "fuzz/step000000007.ckpt"

// fuzzCk is a Checkpointer registered as checkpoint_test's trainer, with 2 rows.
func fuzzCk(t testing.TB) (*Checkpointer, *state) {
	c, err := New(nil, Options{Dir: "fuzz"})
	if err != nil {
		t.Fatal(err)
	}
	s := newState(2)
	s.register(c, 2)
	return c, s
}

// fuzzSeeds are files of step 7 as Save writes them, and a few that are damaged.
func fuzzSeeds(t testing.TB) [][]byte {
	c, s := fuzzCk(t)
	s.fill(1)
	var good bytes.Buffer
	if err := c.encode(&good, 7); err != nil {
		t.Fatal(err)
	}
	g := good.Bytes()
	other, _ := New(nil, Options{Dir: "fuzz"})
	other.Float32("w", make([]float32, 6), 3, 2)
	var wrongShape bytes.Buffer
	if err := other.encode(&wrongShape, 7); err != nil {
		t.Fatal(err)
	}
	flip := bytes.Clone(g)
	flip[len(flip)/2] ^= 1
	return [][]byte{g, wrongShape.Bytes(), g[:len(g)-9], flip, []byte(magic)}
}

// withCRC appends the CRC that Save would write after body.
func withCRC(body []byte) []byte {
	return binary.LittleEndian.AppendUint32(bytes.Clone(body), crc32.ChecksumIEEE(body))
}

// fuzzDecode decodes file into a registered state: it must not panic; an error names the
// file and leaves the state as it was.
func fuzzDecode(t *testing.T, file []byte) {
	c, s := fuzzCk(t)
	s.fill(2)
	before := newState(2)
	before.fill(2)
	err := c.decode(bytes.NewReader(file), int64(len(file)), fuzzPath, 7)
	if err != nil {
		if !strings.Contains(err.Error(), fuzzPath) {
			t.Fatalf("error %q does not name the file", err)
		}
		if !s.equal(before) {
			t.Fatalf("a refused file (%v) changed the state", err)
		}
	}
}

// FuzzDecode: a checkpoint file of arbitrary bytes (its CRC is checked first, so few get
// further: FuzzDecodeBody reaches the rest).
func FuzzDecode(f *testing.F) {
	for _, b := range fuzzSeeds(f) {
		f.Add(b)
	}
	f.Fuzz(fuzzDecode)
}

// FuzzDecodeBody: a checkpoint file of arbitrary bytes with the right CRC, so that the
// header and table decoder see them.
func FuzzDecodeBody(f *testing.F) {
	for _, b := range fuzzSeeds(f) {
		if len(b) >= 4 {
			f.Add(b[:len(b)-4])
		}
	}
	f.Fuzz(func(t *testing.T, body []byte) { fuzzDecode(t, withCRC(body)) })
}

// The seeds decode as they should: the file Save writes restores the state it was written
// from, on disk too.
func TestFuzzSeedsDecode(t *testing.T) {
	seeds := fuzzSeeds(t)
	c, s := fuzzCk(t)
	want := newState(2)
	want.fill(1)
	dir := t.TempDir()
	path := filepath.Join(dir, FileName(7))
	if err := os.WriteFile(path, seeds[0], 0o600); err != nil {
		t.Fatal(err)
	}
	if err := c.load(path, 7); err != nil {
		t.Fatal(err)
	}
	if !s.equal(want) {
		t.Fatal("the state read back differs from the one saved")
	}
	for i, b := range seeds[1:] {
		if err := c.decode(bytes.NewReader(b), int64(len(b)), fuzzPath, 7); err == nil {
			t.Errorf("damaged seed %d: decoded without error", i+1)
		}
	}
}
