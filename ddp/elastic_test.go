package ddp

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// The error file has the layout torch's ErrorHandler.record_exception writes, which
// torchrun's failure summary reads (message.extraInfo.py_callstack, timestamp).
func TestRecordFailure(t *testing.T) {
	path := filepath.Join(t.TempDir(), "error.json")
	t.Setenv(ElasticErrorFileEnv, path)
	if err := RecordFailure(errors.New("rank 1: step 3: peer closed")); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Message struct {
			Message   string `json:"message"`
			ExtraInfo struct {
				PyCallstack string `json:"py_callstack"`
				Timestamp   string `json:"timestamp"`
			} `json:"extraInfo"`
		} `json:"message"`
	}
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatalf("%s: %v", b, err)
	}
	if got.Message.Message != "rank 1: step 3: peer closed" || got.Message.ExtraInfo.PyCallstack != got.Message.Message {
		t.Fatalf("error file %s", b)
	}
	if ts, err := strconv.ParseInt(got.Message.ExtraInfo.Timestamp, 10, 64); err != nil || ts <= 0 {
		t.Fatalf("timestamp %q: %v", got.Message.ExtraInfo.Timestamp, err)
	}

	// Not under torchrun: nothing is written.
	os.Unsetenv(ElasticErrorFileEnv)
	os.Remove(path)
	if err := RecordFailure(errors.New("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("error file written without %s: %v", ElasticErrorFileEnv, err)
	}
}
