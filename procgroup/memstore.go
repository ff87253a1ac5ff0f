package procgroup

import (
	"bytes"
	"context"
	"fmt"
	"strconv"
	"sync"
)

// MemStore is an in-process Store: the state behind the gRPC store server, and a store for
// tests whose ranks are goroutines of one process.
type MemStore struct {
	mu      sync.Mutex // guards the fields below
	data    map[string][]byte
	changed chan struct{} // closed and replaced on every change
	closed  bool
}

// NewMemStore returns an empty store.
func NewMemStore() *MemStore {
	return &MemStore{data: map[string][]byte{}, changed: make(chan struct{})}
}

var _ Store = (*MemStore)(nil)

// notify wakes waiters; s.mu must be held.
func (s *MemStore) notify() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// Set implements Store.
func (s *MemStore) Set(_ context.Context, key string, value []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return ErrStoreClosed
	}
	s.data[key] = bytes.Clone(value)
	s.notify()
	return nil
}

// Get implements Store.
func (s *MemStore) Get(ctx context.Context, key string) ([]byte, error) {
	for {
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			return nil, ErrStoreClosed
		}
		v, ok := s.data[key]
		ch := s.changed
		s.mu.Unlock()
		if ok {
			return bytes.Clone(v), nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, fmt.Errorf("procgroup: store get %q: %w", key, ctx.Err())
		}
	}
}

// Add implements Store.
func (s *MemStore) Add(_ context.Context, key string, delta int64) (int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, ErrStoreClosed
	}
	var cur int64
	if v, ok := s.data[key]; ok {
		n, err := strconv.ParseInt(string(v), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%w: store add %q: value is not an integer", ErrInvalidArgument, key)
		}
		cur = n
	}
	cur += delta
	s.data[key] = []byte(strconv.FormatInt(cur, 10))
	s.notify()
	return cur, nil
}

// CompareAndSet implements Store.
func (s *MemStore) CompareAndSet(_ context.Context, key string, expected, desired []byte) ([]byte, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, false, ErrStoreClosed
	}
	cur, ok := s.data[key]
	if (expected == nil && !ok) || (expected != nil && ok && bytes.Equal(cur, expected)) {
		s.data[key] = bytes.Clone(desired)
		s.notify()
		return bytes.Clone(desired), true, nil
	}
	return bytes.Clone(cur), false, nil
}

// Delete implements Store.
func (s *MemStore) Delete(_ context.Context, key string) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false, ErrStoreClosed
	}
	_, ok := s.data[key]
	delete(s.data, key)
	if ok {
		s.notify()
	}
	return ok, nil
}

// Wait implements Store.
func (s *MemStore) Wait(ctx context.Context, keys ...string) error {
	for {
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			return ErrStoreClosed
		}
		missing := ""
		for _, k := range keys {
			if _, ok := s.data[k]; !ok {
				missing = k
				break
			}
		}
		ch := s.changed
		s.mu.Unlock()
		if missing == "" {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("procgroup: store wait for %q: %w", missing, ctx.Err())
		}
	}
}

// Len is the number of keys held.
func (s *MemStore) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.data)
}

// Close implements Store; waiters fail with ErrStoreClosed.
func (s *MemStore) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.closed {
		s.closed = true
		s.notify()
	}
	return nil
}

// PrefixStore namespaces every key of an underlying store: key k becomes Prefix+"/"+k.
// Close does not close the underlying store.
type PrefixStore struct {
	Prefix string
	Store  Store
}

var _ Store = PrefixStore{}

func (p PrefixStore) k(key string) string { return p.Prefix + "/" + key }

// Set implements Store.
func (p PrefixStore) Set(ctx context.Context, key string, value []byte) error {
	return p.Store.Set(ctx, p.k(key), value)
}

// Get implements Store.
func (p PrefixStore) Get(ctx context.Context, key string) ([]byte, error) {
	return p.Store.Get(ctx, p.k(key))
}

// Add implements Store.
func (p PrefixStore) Add(ctx context.Context, key string, delta int64) (int64, error) {
	return p.Store.Add(ctx, p.k(key), delta)
}

// CompareAndSet implements Store.
func (p PrefixStore) CompareAndSet(ctx context.Context, key string, expected, desired []byte) ([]byte, bool, error) {
	return p.Store.CompareAndSet(ctx, p.k(key), expected, desired)
}

// Delete implements Store.
func (p PrefixStore) Delete(ctx context.Context, key string) (bool, error) {
	return p.Store.Delete(ctx, p.k(key))
}

// Wait implements Store.
func (p PrefixStore) Wait(ctx context.Context, keys ...string) error {
	pk := make([]string, len(keys))
	for i, k := range keys {
		pk[i] = p.k(k)
	}
	return p.Store.Wait(ctx, pk...)
}

// Close implements Store; the underlying store stays open.
func (p PrefixStore) Close() error { return nil }
