// Package openblascore names the OpenBLAS kernel set that suits this CPU, and tells when
// OpenBLAS picked an older one. Debian's OpenBLAS 0.3.21 does not know recent Xeons and falls
// back to its Prescott (SSE3) kernels on them, several times slower than its AVX-512 ones;
// OPENBLAS_CORETYPE overrides its choice (in its DYNAMIC_ARCH builds, as Debian's is). ddprun
// sets that variable for its ranks (CoreType); the trainers' OpenBLAS build warns when the
// choice is off (Advice).
package openblascore

import (
	"fmt"
	"strings"

	"golang.org/x/sys/cpu"
)

// Features are the CPU features the choice depends on.
type Features struct {
	AVX512 bool // AVX-512 F, BW, DQ and VL: OpenBLAS's SkylakeX kernels
	AVX2   bool // AVX2 and FMA: its Haswell kernels
}

// Host returns this CPU's features.
func Host() Features {
	return Features{
		AVX512: cpu.X86.HasAVX512F && cpu.X86.HasAVX512BW && cpu.X86.HasAVX512DQ && cpu.X86.HasAVX512VL,
		AVX2:   cpu.X86.HasAVX2 && cpu.X86.HasFMA,
	}
}

// CoreType is the OPENBLAS_CORETYPE for a CPU with f: SkylakeX with AVX-512, Haswell with
// AVX2 and FMA, "" otherwise (OpenBLAS's own choice is then as good).
func CoreType(f Features) string {
	switch {
	case f.AVX512:
		return "SkylakeX"
	case f.AVX2:
		return "Haswell"
	}
	return ""
}

// oldCores are OpenBLAS's x86 kernel sets without AVX2 (openblas_get_corename's answers).
var oldCores = map[string]bool{
	"katmai": true, "coppermine": true, "northwood": true, "prescott": true, "banias": true,
	"atom": true, "core2": true, "penryn": true, "dunnington": true, "nehalem": true,
	"sandybridge": true, "athlon": true, "opteron": true, "opteron(sse3)": true,
	"barcelona": true, "bobcat": true, "bulldozer": true, "piledriver": true,
	"steamroller": true, "excavator": true, "nano": true, "generic": true, "unknown": true,
}

// Advice returns a warning when OpenBLAS's chosen core (openblas_get_corename) lacks AVX2
// on a CPU with f that has it, or "" when the choice is right. coretype is the
// OPENBLAS_CORETYPE the process was given, if any.
func Advice(core string, f Features, coretype string) string {
	want := CoreType(f)
	if want == "" || !oldCores[strings.ToLower(strings.TrimSpace(core))] {
		return ""
	}
	what := "AVX2"
	if f.AVX512 {
		what = "AVX-512"
	}
	msg := fmt.Sprintf("OpenBLAS is using its %s kernels on a CPU with %s, several times slower than its %s kernels there", core, what, want)
	switch {
	case coretype == "":
		return msg + fmt.Sprintf(": set OPENBLAS_CORETYPE=%s (ddprun sets it for its ranks)", want)
	case strings.EqualFold(coretype, strings.TrimSpace(core)):
		return msg + fmt.Sprintf(": OPENBLAS_CORETYPE=%s asks for them; %s suits this CPU", coretype, want)
	}
	return msg + fmt.Sprintf(": OPENBLAS_CORETYPE=%s did not take (a build without DYNAMIC_ARCH ignores it)", coretype)
}
