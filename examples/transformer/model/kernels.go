package model

import (
	"math"
)

// The kernels of the fused ops (Note [Fused ops]): plain loops over row-major slices,
// matrix products on gemm. Each writes every element of its output, in a fixed order
// (runs are bit-for-bit repeatable).

// linearFwd is y = x·w + b for x [rows, in], w [in, out], b [out], then y = relu(y)
// when relu, then y *= mask when mask is non-nil.
func linearFwd[T float32 | float64](x, w, b []T, rows, in, out int, relu bool, mask, y []T) {
	for r := 0; r < rows; r++ {
		copy(y[r*out:(r+1)*out], b)
	}
	gemm(false, false, rows, out, in, 1, x, in, w, out, 1, y, out)
	switch {
	case relu:
		reluMask(y, mask)
	case mask != nil:
		mul(y, mask, y)
	}
}

// reluMask is y = relu(y)⊙mask (mask nil: all ones). The float32 path is branch-free:
// the sign of a random pre-activation is unpredictable, and a mispredicted branch per
// element costs more than the arithmetic.
func reluMask[T float32 | float64](y, mask []T) {
	switch y := any(y).(type) {
	case []float32:
		if mask == nil {
			for i, v := range y {
				b := math.Float32bits(v)
				y[i] = math.Float32frombits(b &^ uint32(int32(b)>>31))
			}
			return
		}
		m := any(mask).([]float32)[:len(y)]
		for i, v := range y {
			neg := uint32(int32(math.Float32bits(v)) >> 31) // all ones when v < 0 (or −0)
			y[i] = math.Float32frombits(math.Float32bits(v*m[i]) &^ neg)
		}
	case []float64:
		for i, v := range y {
			if v <= 0 {
				y[i] = 0
			} else if mask != nil {
				y[i] = v * float64(mask[i])
			}
		}
	}
}

// actGrad is the gradient through linearFwd's epilogue: dpre = dy·mask where the
// (masked) output y is positive (relu) or everywhere (no relu). Where relu is on and
// the mask is 0, y is 0 and the gradient is 0 either way, so y alone decides. With
// relu, y ≥ +0 (reluMask never yields −0), so "y > 0" is "y's bits are not 0".
func actGrad[T float32 | float64](y, dy, mask []T, relu bool, dpre []T) {
	dy = dy[:len(dpre)]
	y = y[:len(dpre)]
	switch {
	case relu:
		if mask == nil {
			copy(dpre, dy)
		} else {
			mul(dy, mask, dpre)
		}
		switch d := any(dpre).(type) {
		case []float32:
			y := any(y).([]float32)[:len(d)]
			for i, v := range y {
				b := math.Float32bits(v)
				keep := -((b | -b) >> 31) // all ones when b != 0
				d[i] = math.Float32frombits(math.Float32bits(d[i]) & keep)
			}
		case []float64:
			y := any(y).([]float64)[:len(d)]
			for i, v := range y {
				if !(v > 0) {
					d[i] = 0
				}
			}
		}
	case mask != nil:
		mul(dy, mask, dpre)
	default:
		copy(dpre, dy)
	}
}

// mul is out = a ⊙ b.
func mul[T float32 | float64](a, b, out []T) {
	a, b = a[:len(out)], b[:len(out)]
	for i := range out {
		out[i] = a[i] * b[i]
	}
}

// colSum is out[j] = Σ_r a[r, j] for a [rows, n]: aᵀ·ones on the BLAS (a vectorised
// gemv; ones holds rows ones).
func colSum[T float32 | float64](a []T, rows, n int, ones, out []T) {
	gemv(true, rows, n, 1, a, n, ones, 0, out)
}

// colDot is out[j] = Σ_r a[r, j]·b[r, j].
func colDot[T float32 | float64](a, b []T, rows, n int, out []T) {
	clear(out[:n])
	for r := 0; r < rows; r++ {
		ra, rb := a[r*n:(r+1)*n], b[r*n:(r+1)*n]
		for j, v := range ra {
			out[j] += v * rb[j]
		}
	}
}

func sqrt[T float32 | float64](v T) T { return T(math.Sqrt(float64(v))) }

// addLNFwd is y = LayerNorm(x + mask⊙s)·gamma + beta over rows of width n (biased
// variance, eps as PyTorch's 1e-5). It keeps xhat (the normalised input) and rstd
// (1/√(var+eps) per row) for the backward.
func addLNFwd[T float32 | float64](x, s, mask, gamma, beta []T, rows, n int, y, xhat, rstd []T) {
	const eps = 1e-5
	inv := 1 / T(n)
	for r := 0; r < rows; r++ {
		xr, sr, zr, yr := x[r*n:(r+1)*n], s[r*n:(r+1)*n], xhat[r*n:(r+1)*n], y[r*n:(r+1)*n]
		var sum T
		if mask != nil {
			mr := mask[r*n : (r+1)*n]
			for j, v := range xr {
				z := v + sr[j]*mr[j]
				zr[j] = z
				sum += z
			}
		} else {
			for j, v := range xr {
				z := v + sr[j]
				zr[j] = z
				sum += z
			}
		}
		mean := sum * inv
		var ss T
		for j, z := range zr {
			d := z - mean
			zr[j] = d
			ss += d * d
		}
		rs := 1 / sqrt(ss*inv+eps)
		rstd[r] = rs
		for j, d := range zr {
			xh := d * rs
			zr[j] = xh
			yr[j] = xh*gamma[j] + beta[j]
		}
	}
}

// lnBwd is the gradient of addLNFwd with respect to its normalised sum z:
// dz = rstd·(g − mean(g) − xhat·mean(g·xhat)) with g = dy⊙gamma.
func lnBwd[T float32 | float64](dy, gamma, xhat, rstd []T, rows, n int, dz []T) {
	inv := 1 / T(n)
	for r := 0; r < rows; r++ {
		dyr, xr, dzr := dy[r*n:(r+1)*n], xhat[r*n:(r+1)*n], dz[r*n:(r+1)*n]
		var a, c T
		for j, v := range dyr {
			g := v * gamma[j]
			dzr[j] = g
			a += g
			c += g * xr[j]
		}
		a *= inv
		c *= inv
		rs := rstd[r]
		for j, g := range dzr {
			dzr[j] = rs * (g - a - xr[j]*c)
		}
	}
}

// softmaxRows replaces every row of p [rows, n] by its softmax.
func softmaxRows[T float32 | float64](p []T, rows, n int) {
	switch p := any(p).(type) {
	case []float32:
		for r := 0; r < rows; r++ {
			row := p[r*n : (r+1)*n]
			m := row[0]
			for _, v := range row[1:] {
				m = max(m, v)
			}
			var sum float32
			for j, v := range row {
				e := expNeg32(v - m)
				row[j] = e
				sum += e
			}
			inv := 1 / sum
			for j := range row {
				row[j] *= inv
			}
		}
	case []float64:
		for r := 0; r < rows; r++ {
			row := p[r*n : (r+1)*n]
			m := row[0]
			for _, v := range row[1:] {
				m = max(m, v)
			}
			var sum float64
			for j, v := range row {
				e := math.Exp(v - m)
				row[j] = e
				sum += e
			}
			inv := 1 / sum
			for j := range row {
				row[j] *= inv
			}
		}
	}
}

// expNeg32 is e^x for x ≤ 0 (softmax arguments after the row maximum is subtracted)
// to within a few float32 ulps, 0 below −87 (where e^x leaves float32's normal
// range). It is several times faster than math32.Exp: x = k·ln2 + r with |r| ≤ ln2/2,
// e^r by its degree-7 Taylor polynomial (truncation error < 6e−9), 2^k by exponent
// bits.
func expNeg32(x float32) float32 {
	if !(x >= -87) { // also NaN → 0
		return 0
	}
	const (
		log2e = 1.44269504088896341
		ln2hi = 0.693145751953125 // ln2 split so that k·ln2hi is exact
		ln2lo = 1.428606820309417232e-06
	)
	k := -int32(-x*log2e + 0.5) // round(x·log2 e), x ≤ 0
	kf := float32(k)
	r := (x - kf*ln2hi) - kf*ln2lo
	p := 1 + r*(1+r*(1.0/2+r*(1.0/6+r*(1.0/24+r*(1.0/120+r*(1.0/720+r*(1.0/5040)))))))
	return p * math.Float32frombits(uint32(k+127)<<23)
}

// attnDims are the shapes of one multi-head self-attention: batch, sequence, heads,
// head width; alpha is the score scale 1/√dh.
type attnDims struct {
	B, S, H, dh int
	alpha       float64
}

// attnFwd computes, for every sample b and head hd, with Q, K, V the head's columns of
// qkv [B·S, 3h] (read in place, leading dimension 3h):
//
//	P = softmax(alpha·Q·Kᵀ);  Pd = P⊙mask;  ctx[b, :, hd] = Pd·V
//
// writing ctx [B·S, h] (heads merged, leading dimension h) and keeping P and Pd
// [B·H, S, S] for the backward (Pd aliases P when mask is nil).
func attnFwd[T float32 | float64](d attnDims, qkv, mask, p, pd, ctx []T) {
	S, dh := d.S, d.dh
	h := d.H * dh
	ss := S * S
	for b := 0; b < d.B; b++ {
		off := b * S * 3 * h
		for hd := 0; hd < d.H; hd++ {
			i := b*d.H + hd
			q, k, v := qkv[off+hd*dh:], qkv[off+h+hd*dh:], qkv[off+2*h+hd*dh:]
			pi := p[i*ss : (i+1)*ss]
			gemm(false, true, S, S, dh, T(d.alpha), q, 3*h, k, 3*h, 0, pi, S)
			softmaxRows(pi, S, S)
			pdi := pi
			if mask != nil {
				pdi = pd[i*ss : (i+1)*ss]
				mul(pi, mask[i*ss:(i+1)*ss], pdi)
			}
			gemm(false, false, S, dh, S, 1, pdi, S, v, 3*h, 0, ctx[b*S*h+hd*dh:], h)
		}
	}
}

// attnBwd is attnFwd's gradient: from dctx [B·S, h] it writes dqkv [B·S, 3h], using
// the P and Pd kept by the forward and a scratch ds of S·S elements:
//
//	dPd = dctx·Vᵀ;  dV = Pdᵀ·dctx;  dP = dPd⊙mask;  dS = P⊙(dP − rowsum(dP⊙P))
//	dQ = alpha·dS·K;  dK = alpha·dSᵀ·Q
func attnBwd[T float32 | float64](d attnDims, qkv, mask, p, pd, dctx, ds, dqkv []T) {
	S, dh := d.S, d.dh
	h := d.H * dh
	ss := S * S
	alpha := T(d.alpha)
	for b := 0; b < d.B; b++ {
		off := b * S * 3 * h
		for hd := 0; hd < d.H; hd++ {
			i := b*d.H + hd
			q, k, v := qkv[off+hd*dh:], qkv[off+h+hd*dh:], qkv[off+2*h+hd*dh:]
			dc := dctx[b*S*h+hd*dh:]
			pi := p[i*ss : (i+1)*ss]
			pdi := pi
			if mask != nil {
				pdi = pd[i*ss : (i+1)*ss]
			}
			gemm(false, true, S, S, dh, 1, dc, h, v, 3*h, 0, ds, S)                     // dPd
			gemm(true, false, S, dh, S, 1, pdi, S, dc, h, 0, dqkv[off+2*h+hd*dh:], 3*h) // dV
			if mask != nil {
				mul(ds, mask[i*ss:(i+1)*ss], ds)
			}
			for r := 0; r < S; r++ {
				dr, pr := ds[r*S:(r+1)*S], pi[r*S:(r+1)*S]
				var dot T
				for j, v := range dr {
					dot += v * pr[j]
				}
				for j, v := range dr {
					dr[j] = pr[j] * (v - dot)
				}
			}
			gemm(false, false, S, dh, S, alpha, ds, S, k, 3*h, 0, dqkv[off+hd*dh:], 3*h)  // dQ
			gemm(true, false, S, dh, S, alpha, ds, S, q, 3*h, 0, dqkv[off+h+hd*dh:], 3*h) // dK
		}
	}
}
