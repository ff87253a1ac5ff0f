package ddp

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestLeanCore: package ddp, a trainer that brings its own gradients (examples/mlp) and the
// trace plotter link no gorgonia, and the first two no Prometheus client either; those live
// in gorgoniaddp and metrics, which a trainer imports only if it wants them.
func TestLeanCore(t *testing.T) {
	const mod = "github.com/goddp/goddp/"
	for _, tc := range []struct {
		pkg       string
		forbidden []string
	}{
		{mod + "ddp", []string{"gorgonia.org/", "github.com/prometheus/"}},
		{mod + "examples/mlp", []string{"gorgonia.org/", "github.com/prometheus/"}},
		{mod + "cmd/trace-plot", []string{"gorgonia.org/"}},
	} {
		out, err := exec.Command(goTool(), "list", "-deps", tc.pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list -deps %s: %v\n%s", tc.pkg, err, out)
		}
		deps := strings.Fields(string(out))
		if len(deps) < 10 {
			t.Fatalf("go list -deps %s listed only %q", tc.pkg, deps)
		}
		for _, dep := range deps {
			for _, f := range tc.forbidden {
				if strings.HasPrefix(dep, f) {
					t.Errorf("%s links %s", tc.pkg, dep)
				}
			}
		}
	}
}

func goTool() string {
	if p := filepath.Join(os.Getenv("GOROOT"), "bin", "go"); os.Getenv("GOROOT") != "" {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return "go"
}
