package ddp

import (
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"time"
)

// ElasticErrorFileEnv names the variable in which torchrun's elastic agent tells each worker
// where to write the error that made it fail.
const ElasticErrorFileEnv = "TORCHELASTIC_ERROR_FILE"

// RecordFailure writes err where torchrun's agent reads a failed worker's root cause (the
// file named by $TORCHELASTIC_ERROR_FILE), in the JSON layout torch's own workers use
// (torch.distributed.elastic.multiprocessing.errors.ErrorHandler.record_exception):
//
//	{"message": {"message": "...", "extraInfo": {"py_callstack": "...", "timestamp": "<unix seconds>"}}}
//
// torchrun prints py_callstack as the failure's "traceback"; here it is the error's text.
// Without the variable (not under torchrun) it does nothing. Call it once, just before the
// process exits with a non-zero status.
func RecordFailure(err error) error {
	path, ok := os.LookupEnv(ElasticErrorFileEnv)
	if !ok || path == "" || err == nil {
		return nil
	}
	msg := err.Error()
	data := map[string]any{
		"message": map[string]any{
			"message": msg,
			"extraInfo": map[string]string{
				"py_callstack": msg,
				"timestamp":    strconv.FormatInt(time.Now().Unix(), 10),
			},
		},
	}
	b, jerr := json.Marshal(data)
	if jerr != nil {
		return fmt.Errorf("ddp: %s: %w", ElasticErrorFileEnv, jerr)
	}
	if werr := os.WriteFile(path, b, 0o644); werr != nil {
		return fmt.Errorf("ddp: %s: %w", ElasticErrorFileEnv, werr)
	}
	return nil
}
