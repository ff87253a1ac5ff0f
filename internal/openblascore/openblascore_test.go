package openblascore

import (
	"strings"
	"testing"
)

func TestCoreTypeAndAdvice(t *testing.T) {
	avx512, avx2, none := Features{AVX512: true, AVX2: true}, Features{AVX2: true}, Features{}
	for _, tc := range []struct {
		f    Features
		want string
	}{{avx512, "SkylakeX"}, {avx2, "Haswell"}, {none, ""}} {
		if got := CoreType(tc.f); got != tc.want {
			t.Errorf("CoreType(%+v) = %q, want %q", tc.f, got, tc.want)
		}
	}
	for _, tc := range []struct {
		core     string
		f        Features
		coretype string
		want     string // a part of the advice; "" for none
	}{
		{"Prescott", avx512, "", "OpenBLAS is using its Prescott kernels on a CPU with AVX-512, several times slower than its SkylakeX kernels there: set OPENBLAS_CORETYPE=SkylakeX"},
		{"Sandybridge", avx2, "", "set OPENBLAS_CORETYPE=Haswell"},
		{"Prescott", avx512, "SkylakeX", "OPENBLAS_CORETYPE=SkylakeX did not take"},
		{"Prescott", avx512, "prescott", "OPENBLAS_CORETYPE=prescott asks for them; SkylakeX suits this CPU"},
		{"SkylakeX", avx512, "", ""},
		{"Haswell", avx2, "", ""},
		{"Zen", avx2, "", ""},
		{"Prescott", none, "", ""}, // nothing better on this CPU
	} {
		got := Advice(tc.core, tc.f, tc.coretype)
		if (tc.want == "") != (got == "") || !strings.Contains(got, tc.want) {
			t.Errorf("Advice(%q, %+v, %q) = %q, want one containing %q", tc.core, tc.f, tc.coretype, got, tc.want)
		}
	}
}
