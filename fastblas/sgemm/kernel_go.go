package sgemm

import "unsafe"

// goKernel is the portable 4×8 micro-kernel: the same contract as the assembly ones.
var goKernel = func() microKernel {
	k := microKernel{name: "go 4x8", mr: 4, nr: 8}
	for h := 1; h <= k.mr; h++ {
		k.colA = append(k.colA, func(k int, a *float32, lda int, b, c *float32, ldc int, alpha float32, add bool) {
			kernelGo(h, k, a, 1, lda, b, c, ldc, alpha, add)
		})
		k.rowA = append(k.rowA, func(k int, a *float32, lda int, b, c *float32, ldc int, alpha float32, add bool) {
			kernelGo(h, k, a, lda, 1, b, c, ldc, alpha, add)
		})
	}
	return k
}()

// kernelGo is the h×8 kernel (h ≤ 4) with A[r,p] at a[r*rs+p*ps].
func kernelGo(h, k int, a *float32, rs, ps int, b, c *float32, ldc int, alpha float32, add bool) {
	const nr = 8
	as := unsafe.Slice(a, (h-1)*rs+(k-1)*ps+1)
	bp := unsafe.Slice(b, k*nr)
	var acc [4][nr]float32
	for p := 0; p < k; p++ {
		bs := (*[nr]float32)(bp[p*nr:])
		for r := 0; r < h; r++ {
			av := as[r*rs+p*ps]
			row := &acc[r]
			for j, bv := range bs {
				row[j] += av * bv
			}
		}
	}
	cs := unsafe.Slice(c, (h-1)*ldc+nr)
	for r := 0; r < h; r++ {
		row := cs[r*ldc : r*ldc+nr]
		for j, v := range acc[r] {
			if add {
				row[j] += alpha * v
			} else {
				row[j] = alpha * v
			}
		}
	}
}
