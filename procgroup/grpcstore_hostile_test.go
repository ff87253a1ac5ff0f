package procgroup

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// Well-formed but hostile requests (huge keys, values and wait lists, from many clients at
// once) are refused with an error that names the server and the limit; the server neither
// panics nor decodes a refused wait list, and it goes on serving an honest client.
func TestGRPCStoreHostileClients(t *testing.T) {
	const maxWait = 64
	s := startServer(t, StoreServerOptions{MaxKeyBytes: 64, MaxValueBytes: 1 << 20, MaxWaitKeys: maxWait})
	honest := dial(t, s.Addr(), testToken)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	refused := func(what string, err error, limit string) {
		t.Helper()
		if err == nil {
			t.Fatalf("%s: accepted", what)
		}
		if msg := err.Error(); !strings.Contains(msg, s.Addr()) || !strings.Contains(msg, limit) {
			t.Fatalf("%s: %.300q; want the server %s and the limit %q named", what, msg, s.Addr(), limit)
		}
	}
	err := honest.Set(ctx, strings.Repeat("k", 1<<16), nil)
	refused("huge key", err, "limit of 64")
	if len(err.Error()) > 400 {
		t.Fatalf("the error for a huge key is %d bytes long: it quotes the key whole", len(err.Error()))
	}
	refused("huge value", honest.Set(ctx, "k", make([]byte, 2<<20)), "larger than max")
	refused("wait list over the limit", honest.Wait(ctx, waitKeys(maxWait+1, 1)...), fmt.Sprint(maxWait))

	// A wait list of one-byte keys as long as the message bound allows (~350,000 keys in
	// 1 MiB) is refused on the wire: the server's allocation stays near the message's size,
	// where decoding it would cost ~16 bytes a key more.
	big := make([]string, (1<<20)/3) // 3 bytes a key on the wire: the tag, the length, "a"
	for i := range big {
		big[i] = "a"
	}
	var ms0, ms1 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	const tries = 4
	for range tries {
		refused("long wait list", honest.Wait(ctx, big...), fmt.Sprint(maxWait))
	}
	runtime.ReadMemStats(&ms1)
	// Per try: the client marshals 1 MiB, the server receives it into 1 MiB; decoding would
	// add ~8 MiB of strings and slice.
	if per := (ms1.TotalAlloc - ms0.TotalAlloc) / tries; per > 4<<20 {
		t.Fatalf("a refused wait list of %d keys allocated %d bytes", len(big), per)
	}

	// Many clients at once, each hostile in its own way, while the honest one works.
	const clients = 16
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for i := range clients {
		st := dial(t, s.Addr(), testToken)
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			switch i % 3 {
			case 0:
				err = st.Wait(ctx, waitKeys(maxWait*4, i)...)
			case 1:
				err = st.Set(ctx, fmt.Sprintf("v%d", i), make([]byte, 2<<20))
			case 2:
				err = st.Set(ctx, strings.Repeat("x", 1000+i), []byte("v"))
			}
			if err == nil {
				err = fmt.Errorf("client %d: a hostile call was accepted", i)
			} else if errors.Is(err, context.DeadlineExceeded) {
				err = fmt.Errorf("client %d: %w", i, err)
			} else {
				err = nil
			}
			errs <- err
		}()
	}
	for i := range 50 {
		k := fmt.Sprintf("honest%d", i)
		if err := honest.Set(ctx, k, []byte(k)); err != nil {
			t.Fatalf("honest Set during the attack: %v", err)
		}
		if v, err := honest.Get(ctx, k); err != nil || string(v) != k {
			t.Fatalf("honest Get during the attack = %q, %v", v, err)
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	// A wait at the limit is served.
	keys := waitKeys(maxWait, 99)
	for _, k := range keys {
		if err := honest.Set(ctx, k, nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := honest.Wait(ctx, keys...); err != nil {
		t.Fatalf("a wait for %d keys, the limit: %v", maxWait, err)
	}
}

// waitKeys is n distinct keys.
func waitKeys(n, seed int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("%x", i*7+seed)
	}
	return keys
}
