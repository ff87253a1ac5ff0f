package procgroup

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"
)

// The TCPStore client runs against the real PyTorch TCPStore (python3 with torch, where
// installed) and against fakeTCPStore, a server written here from PyTorch's source for
// each dialect (Note [TCPStore wire protocol]).

// torchStoreScript serves a TCPStore, prints its port, then answers "get KEY" lines
// (the value in hex, read with torch's own client) and "set KEY HEX" lines, and exits at
// the end of its stdin.
const torchStoreScript = `
import sys
from datetime import timedelta
import torch.distributed as dist
st = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30), wait_for_workers=False)
print(st.port, flush=True)
for line in sys.stdin:
    f = line.split()
    if f[0] == "get":
        print(st.get(f[1]).hex(), flush=True)
    elif f[0] == "set":
        st.set(f[1], bytes.fromhex(f[2]))
        print("ok", flush=True)
`

var torchPythonOnce = sync.OnceValue(func() string {
	// Debian's python3-torch is in /usr/bin/python3, which need not be the first python3
	// on PATH.
	for _, py := range []string{"python3", "/usr/bin/python3"} {
		if p, err := exec.LookPath(py); err == nil && exec.Command(p, "-c", "import torch.distributed").Run() == nil {
			return p
		}
	}
	return ""
})

// torchPython is a python3 that has torch, or "".
func torchPython() string { return torchPythonOnce() }

// torchStore is a real torch.distributed.TCPStore server in a python3 child process.
type torchStore struct {
	addr string
	in   io.WriteCloser
	out  *bufio.Scanner
	mu   sync.Mutex
}

// startTorchStore starts a torch TCPStore, or skips the test where python3 has no torch.
func startTorchStore(t *testing.T) *torchStore {
	t.Helper()
	py := torchPython()
	if py == "" {
		t.Skip("no python3 with torch.distributed: cannot start a real torch TCPStore (Debian: apt-get install python3-torch)")
	}
	cmd := exec.Command(py, "-c", torchStoreScript)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	outPipe, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ts := &torchStore{in: in, out: bufio.NewScanner(outPipe)}
	t.Cleanup(func() {
		in.Close() // the script ends with its stdin
		cmd.Wait()
	})
	if !ts.out.Scan() {
		t.Fatalf("torch TCPStore did not print its port: %v", ts.out.Err())
	}
	ts.addr = net.JoinHostPort("127.0.0.1", strings.TrimSpace(ts.out.Text()))
	return ts
}

func (ts *torchStore) call(t *testing.T, line string) string {
	t.Helper()
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if _, err := fmt.Fprintln(ts.in, line); err != nil {
		t.Fatal(err)
	}
	if !ts.out.Scan() {
		t.Fatalf("torch store helper: no answer to %q: %v", line, ts.out.Err())
	}
	return strings.TrimSpace(ts.out.Text())
}

// fakeTCPStore serves one dialect of the TCPStore protocol from a MemStore.
type fakeTCPStore struct {
	ln      net.Listener
	dialect TCPStoreDialect
	mem     *MemStore
	wg      sync.WaitGroup
	mu      sync.Mutex
	conns   map[net.Conn]struct{}
}

func startFakeTCPStore(t *testing.T, d TCPStoreDialect) *fakeTCPStore {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeTCPStore{ln: ln, dialect: d, mem: NewMemStore(), conns: map[net.Conn]struct{}{}}
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			f.mu.Lock()
			f.conns[c] = struct{}{}
			f.mu.Unlock()
			f.wg.Add(1)
			go func() {
				defer f.wg.Done()
				defer c.Close()
				f.serve(c)
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		f.mem.Close() // wakes blocked waits
		f.mu.Lock()
		for c := range f.conns {
			c.Close()
		}
		f.mu.Unlock()
		f.wg.Wait()
	})
	return f
}

func (f *fakeTCPStore) addr() string { return f.ln.Addr().String() }

// serve handles one connection until it fails; like torch's server, any error drops it.
func (f *fakeTCPStore) serve(c net.Conn) {
	r := bufio.NewReader(c)
	ctx := context.Background()
	u64 := func() (uint64, error) {
		var b [8]byte
		_, err := io.ReadFull(r, b[:])
		return binary.LittleEndian.Uint64(b[:]), err
	}
	vec := func() ([]byte, error) { return readTCPVector(r, 1<<20) }
	keys := func() ([]string, error) {
		n, err := u64()
		if err != nil || n > 1000 {
			return nil, fmt.Errorf("bad key count")
		}
		ks := make([]string, n)
		for i := range ks {
			k, err := vec()
			if err != nil {
				return nil, err
			}
			ks[i] = string(k)
		}
		return ks, nil
	}
	q := legacyQueries
	if f.dialect == TCPStoreValidated {
		q = validatedQueries
		// The first message must be VALIDATE with the magic number.
		var b [5]byte
		if _, err := io.ReadFull(r, b[:]); err != nil || b[0] != tcpValidate || binary.LittleEndian.Uint32(b[1:]) != tcpMagic {
			return
		}
	}
	out := func(b []byte) error { _, err := c.Write(b); return err }
	for {
		op, err := r.ReadByte()
		if err != nil {
			return
		}
		switch {
		case f.dialect == TCPStoreValidated && op == tcpValidate:
			var b [4]byte
			if _, err := io.ReadFull(r, b[:]); err != nil || binary.LittleEndian.Uint32(b[:]) != tcpMagic {
				return
			}
		case f.dialect == TCPStoreValidated && op == tcpPing:
			var b [4]byte
			if _, err := io.ReadFull(r, b[:]); err != nil || out(b[:]) != nil {
				return
			}
		case op == q.set:
			k, err := vec() // a legacy server drops the probe here: the length is too large
			if err != nil {
				return
			}
			v, err := vec()
			if err != nil {
				return
			}
			f.mem.Set(ctx, string(k), v)
		case op == q.get:
			k, err := vec()
			if err != nil {
				return
			}
			v, ok := f.peek(string(k))
			if !ok || out(tcpReq{}.bytes(v)) != nil {
				return
			}
		case op == q.add:
			k, err := vec()
			if err != nil {
				return
			}
			d, err := u64()
			if err != nil {
				return
			}
			n, err := f.mem.Add(ctx, string(k), int64(d))
			if err != nil || out(tcpReq{}.int64(n)) != nil {
				return
			}
		case op == q.compareSet:
			k, err1 := vec()
			exp, err2 := vec()
			des, err3 := vec()
			if err1 != nil || err2 != nil || err3 != nil {
				return
			}
			cur, ok := f.peek(string(k))
			switch {
			case !ok && len(exp) == 0:
				f.mem.Set(ctx, string(k), des)
				cur = des
			case !ok:
				cur = exp
			case bytes.Equal(cur, exp):
				f.mem.Set(ctx, string(k), des)
				cur = des
			}
			if out(tcpReq{}.bytes(cur)) != nil {
				return
			}
		case op == q.check || op == q.wait:
			ks, err := keys()
			if err != nil {
				return
			}
			reply := byte(tcpCheckReady)
			if op == q.wait {
				if f.mem.Wait(ctx, ks...) != nil {
					return
				}
			} else {
				for _, k := range ks {
					if _, ok := f.peek(k); !ok {
						reply = tcpCheckMissing
					}
				}
			}
			if out([]byte{reply}) != nil {
				return
			}
		case op == q.numKeys:
			if out(tcpReq{}.int64(int64(f.mem.Len()))) != nil {
				return
			}
		case op == q.deleteKey:
			k, err := vec()
			if err != nil {
				return
			}
			ok, _ := f.mem.Delete(ctx, string(k))
			n := int64(0)
			if ok {
				n = 1
			}
			if out(tcpReq{}.int64(n)) != nil {
				return
			}
		default:
			return
		}
	}
}

func (f *fakeTCPStore) peek(k string) ([]byte, bool) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	v, err := f.mem.Get(ctx, k)
	return v, err == nil
}

// tcpStoreServers are the servers each TCPStore test runs against.
func tcpStoreServers(t *testing.T) []struct {
	name    string
	addr    string
	dialect TCPStoreDialect
	torch   *torchStore
} {
	type srv = struct {
		name    string
		addr    string
		dialect TCPStoreDialect
		torch   *torchStore
	}
	var out []srv
	for _, d := range []TCPStoreDialect{TCPStoreLegacy, TCPStoreValidated} {
		out = append(out, srv{name: "fake-" + d.String(), addr: startFakeTCPStore(t, d).addr(), dialect: d})
	}
	if torchPython() != "" {
		ts := startTorchStore(t)
		out = append(out, srv{name: "torch", addr: ts.addr, dialect: TCPStoreLegacy, torch: ts})
	} else {
		t.Log("python3 with torch not found: the real TCPStore cases are skipped (Debian: apt-get install python3-torch)")
	}
	return out
}

func dialTCP(t *testing.T, addr string) *TCPStore {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := DialTCPStore(ctx, addr, TCPStoreOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

func TestTCPStoreMethods(t *testing.T) {
	for _, srv := range tcpStoreServers(t) {
		t.Run(srv.name, func(t *testing.T) {
			st := dialTCP(t, srv.addr)
			if st.Dialect() != srv.dialect {
				t.Fatalf("probed dialect %v, want %v", st.Dialect(), srv.dialect)
			}
			ctx := context.Background()
			if err := st.Set(ctx, "a", []byte("alpha")); err != nil {
				t.Fatal(err)
			}
			if err := st.Set(ctx, "empty", nil); err != nil {
				t.Fatal(err)
			}
			if v, err := st.Get(ctx, "a"); err != nil || string(v) != "alpha" {
				t.Fatalf("Get a = %q, %v; want alpha", v, err)
			}
			if v, err := st.Get(ctx, "empty"); err != nil || v == nil || len(v) != 0 {
				t.Fatalf("Get empty = %#v, %v; want a non-nil empty value", v, err)
			}
			for i, want := range []int64{5, 2, 1002} {
				delta := []int64{5, -3, 1000}[i]
				if n, err := st.Add(ctx, "ctr", delta); err != nil || n != want {
					t.Fatalf("Add #%d = %d, %v; want %d", i, n, err, want)
				}
			}
			if v, _ := st.Get(ctx, "ctr"); string(v) != "1002" {
				t.Fatalf("counter reads %q, want 1002", v)
			}
			casCases := []struct {
				name              string
				expected, desired []byte
				wantValue         []byte
				wantSwapped       bool
			}{
				{"absent to v1", nil, []byte("v1"), []byte("v1"), true},
				{"expect absent but present", nil, []byte("x"), []byte("v1"), false},
				{"wrong expected", []byte("nope"), []byte("x"), []byte("v1"), false},
				{"right expected", []byte("v1"), []byte("v2"), []byte("v2"), true},
				{"same value", []byte("v2"), []byte("v2"), []byte("v2"), true},
				{"to empty", []byte("v2"), []byte{}, []byte{}, true},
				{"empty expected matches empty", []byte{}, []byte("v3"), []byte("v3"), true},
			}
			for _, c := range casCases {
				v, ok, err := st.CompareAndSet(ctx, "cas", c.expected, c.desired)
				if err != nil || ok != c.wantSwapped || string(v) != string(c.wantValue) || v == nil {
					t.Fatalf("CAS %s = %q, %v, %v; want %q, %v", c.name, v, ok, err, c.wantValue, c.wantSwapped)
				}
			}
			// An absent key stays absent, with a nil value; the watchdog's peek
			// (expected == desired) too.
			for _, des := range []string{"y", "x"} {
				if v, ok, err := st.CompareAndSet(ctx, "nokey", []byte("x"), []byte(des)); err != nil || ok || v != nil {
					t.Fatalf("CAS x→%s on an absent key = %q, %v, %v; want nil, false", des, v, ok, err)
				}
			}
			if ok, err := st.Check(ctx, "a", "ctr"); err != nil || !ok {
				t.Fatalf("Check present = %v, %v", ok, err)
			}
			if ok, err := st.Check(ctx, "a", "nokey"); err != nil || ok {
				t.Fatalf("Check with a missing key = %v, %v; want false", ok, err)
			}
			n0, err := st.NumKeys(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if ok, err := st.Delete(ctx, "a"); err != nil || !ok {
				t.Fatalf("Delete a = %v, %v; want true", ok, err)
			}
			if ok, err := st.Delete(ctx, "a"); err != nil || ok {
				t.Fatalf("second Delete a = %v, %v; want false", ok, err)
			}
			if n, err := st.NumKeys(ctx); err != nil || n != n0-1 {
				t.Fatalf("NumKeys after a delete = %d, %v; want %d", n, err, n0-1)
			}
			if err := st.Wait(ctx, "ctr", "cas", "empty"); err != nil {
				t.Fatalf("Wait on present keys: %v", err)
			}
			// Adding to a value that is not an integer: the server drops the connection;
			// the error says so, and the store goes on working.
			if _, err := st.Add(ctx, "cas", 1); err == nil || !strings.Contains(err.Error(), "closed the connection") {
				t.Fatalf("Add to a non-integer: %v; want the server's refusal", err)
			}
			if v, err := st.Get(ctx, "ctr"); err != nil || string(v) != "1002" {
				t.Fatalf("Get after a refused request = %q, %v", v, err)
			}
			if srv.torch != nil {
				// torch's own client sees goddp's keys, and goddp sees torch's.
				if got := srv.torch.call(t, "get ctr"); got != hex.EncodeToString([]byte("1002")) {
					t.Fatalf("torch reads ctr as %s", got)
				}
				srv.torch.call(t, "set fromtorch "+hex.EncodeToString([]byte("hi")))
				if v, err := st.Get(ctx, "fromtorch"); err != nil || string(v) != "hi" {
					t.Fatalf("Get fromtorch = %q, %v", v, err)
				}
			}
		})
	}
}

// A Get or Wait on an absent key waits until another client sets it; ctx ends them; Close
// fails the calls in flight.
func TestTCPStoreWaiting(t *testing.T) {
	for _, srv := range tcpStoreServers(t) {
		t.Run(srv.name, func(t *testing.T) {
			waiter := dialTCP(t, srv.addr)
			setter := dialTCP(t, srv.addr)
			ctx := context.Background()
			got := make(chan []byte, 1)
			waited := make(chan error, 1)
			go func() {
				v, err := waiter.Get(ctx, "late")
				if err != nil {
					t.Error(err)
				}
				got <- v
			}()
			go func() { waited <- waiter.Wait(ctx, "late", "later") }()
			if err := setter.Set(ctx, "late", []byte("value")); err != nil {
				t.Fatal(err)
			}
			if v := <-got; string(v) != "value" {
				t.Fatalf("Get = %q; want value", v)
			}
			if err := setter.Set(ctx, "later", []byte("x")); err != nil {
				t.Fatal(err)
			}
			if err := <-waited; err != nil {
				t.Fatalf("Wait: %v", err)
			}

			cctx, cancel := context.WithCancel(ctx)
			errc := make(chan error, 1)
			go func() {
				_, err := waiter.Get(cctx, "never")
				errc <- err
			}()
			cancel()
			if err := <-errc; !errors.Is(err, context.Canceled) {
				t.Fatalf("Get after cancel: %v; want context.Canceled", err)
			}
			if n, err := waiter.Add(ctx, "n", 1); err != nil || n != 1 {
				t.Fatalf("Add after a cancelled Get = %d, %v", n, err)
			}

			// Close fails a Wait in flight with ErrStoreClosed, and every later call.
			started := make(chan struct{})
			go func() {
				close(started)
				errc <- waiter.Wait(ctx, "never")
			}()
			<-started
			waiter.Close()
			if err := <-errc; !errors.Is(err, ErrStoreClosed) {
				t.Fatalf("Wait across Close: %v; want ErrStoreClosed", err)
			}
			if err := waiter.Set(ctx, "k", nil); !errors.Is(err, ErrStoreClosed) {
				t.Fatalf("Set after Close: %v; want ErrStoreClosed", err)
			}
		})
	}
}

// Concurrent adds from several clients are atomic.
func TestTCPStoreAddAtomic(t *testing.T) {
	for _, srv := range tcpStoreServers(t) {
		t.Run(srv.name, func(t *testing.T) {
			const clients, adds = 3, 20
			var wg sync.WaitGroup
			for i := 0; i < clients; i++ {
				st := dialTCP(t, srv.addr)
				wg.Add(1)
				go func() {
					defer wg.Done()
					for j := 0; j < adds; j++ {
						if _, err := st.Add(context.Background(), "atomic", 1); err != nil {
							t.Error(err)
							return
						}
					}
				}()
			}
			wg.Wait()
			st := dialTCP(t, srv.addr)
			if v, err := st.Get(context.Background(), "atomic"); err != nil || string(v) != fmt.Sprint(clients*adds) {
				t.Fatalf("counter = %q, %v; want %d", v, err, clients*adds)
			}
		})
	}
}

func TestDialTCPStoreErrors(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, err := DialTCPStore(ctx, "nohostport", TCPStoreOptions{}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("bad address: %v; want ErrInvalidArgument", err)
	}
	if _, err := DialTCPStore(ctx, "127.0.0.1:1", TCPStoreOptions{Dialect: 7}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("bad dialect: %v; want ErrInvalidArgument", err)
	}
	// Nothing listens: the dial retries until ctx ends, and says so.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	if _, err := DialTCPStore(ctx, addr, TCPStoreOptions{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("no server: %v; want DeadlineExceeded", err)
	}
}

// A reply longer than the bound is refused, not allocated.
func TestTCPStoreReplyBound(t *testing.T) {
	srv := startFakeTCPStore(t, TCPStoreValidated)
	ctx := context.Background()
	st, err := DialTCPStore(ctx, srv.addr(), TCPStoreOptions{Dialect: TCPStoreValidated, MaxValueBytes: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if err := st.Set(ctx, "big", []byte("12345")); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Get(ctx, "big"); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("Get of a value over the bound: %v; want ErrInvalidArgument", err)
	}
}

// FuzzTCPStoreVector: the decoder of the server's length-prefixed replies never panics
// and never returns more than its bound.
func FuzzTCPStoreVector(f *testing.F) {
	f.Add([]byte{3, 0, 0, 0, 0, 0, 0, 0, 'a', 'b', 'c'})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{1, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		v, err := readTCPVector(bytes.NewReader(b), 16)
		if err == nil && (len(v) > 16 || len(v) != int(binary.LittleEndian.Uint64(b[:8]))) {
			t.Fatalf("decoded %d bytes from %x", len(v), b)
		}
	})
}
