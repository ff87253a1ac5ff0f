package procgroup

import (
	"context"
	"errors"
)

// ErrStoreClosed is returned by a Store after Close.
var ErrStoreClosed = errors.New("procgroup: store closed")

// Store is the rendezvous key–value store the ranks of a job share. Methods are safe for
// concurrent use; those that wait honour ctx.
type Store interface {
	// Set stores value under key, replacing any previous value.
	Set(ctx context.Context, key string, value []byte) error
	// Get returns key's value, waiting until the key exists or ctx ends.
	Get(ctx context.Context, key string) ([]byte, error)
	// Add adds delta to the integer counter under key (a missing key counts as 0) and
	// returns the new value, atomically.
	Add(ctx context.Context, key string, delta int64) (int64, error)
	// CompareAndSet sets key to desired if its current value equals expected (a nil
	// expected means "key absent"). It returns the value the key holds afterwards and
	// whether the swap happened.
	CompareAndSet(ctx context.Context, key string, expected, desired []byte) ([]byte, bool, error)
	// Delete removes key and reports whether it existed.
	Delete(ctx context.Context, key string) (bool, error)
	// Wait blocks until every key exists or ctx ends.
	Wait(ctx context.Context, keys ...string) error
	// Close releases the store's connections; later calls fail with ErrStoreClosed.
	Close() error
}
