package reducer

import (
	"go/parser"
	"go/token"
	"strconv"
	"strings"
	"testing"
)

// TestMachineIsPure: machine.go imports the standard library and package bucket only.
func TestMachineIsPure(t *testing.T) {
	f, err := parser.ParseFile(token.NewFileSet(), "machine.go", nil, parser.ImportsOnly)
	if err != nil {
		t.Fatal(err)
	}
	for _, imp := range f.Imports {
		path, _ := strconv.Unquote(imp.Path.Value)
		if strings.Contains(path, ".") && path != "github.com/goddp/goddp/bucket" {
			t.Errorf("machine.go imports %s", path)
		}
	}
}
