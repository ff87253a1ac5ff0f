//go:build amd64 && !purego

#include "textflag.h"

// Eight float32 elements per iteration, widened to two vectors of four float64. Every
// product and sum is one VMULPD or VADDPD, in the Go loops' order: no FMA.

// func dot2AVX2(x *float32, y0, y1 *float64, n int, s0, s1 *[8]float64)
// s0[k] = Σ x[j]·y0[j] over j ≡ k (mod 8), j < n; s1 likewise with y1. n is a
// positive multiple of 8.
TEXT ·dot2AVX2(SB), NOSPLIT, $0-48
	MOVQ   x+0(FP), SI
	MOVQ   y0+8(FP), AX
	MOVQ   y1+16(FP), BX
	MOVQ   n+24(FP), CX
	SHRQ   $3, CX
	VXORPD Y0, Y0, Y0
	VXORPD Y1, Y1, Y1
	VXORPD Y2, Y2, Y2
	VXORPD Y3, Y3, Y3
dotloop:
	VCVTPS2PD 0(SI), Y4
	VCVTPS2PD 16(SI), Y5
	VMULPD    0(AX), Y4, Y6
	VADDPD    Y6, Y0, Y0
	VMULPD    32(AX), Y5, Y7
	VADDPD    Y7, Y1, Y1
	VMULPD    0(BX), Y4, Y8
	VADDPD    Y8, Y2, Y2
	VMULPD    32(BX), Y5, Y9
	VADDPD    Y9, Y3, Y3
	ADDQ      $32, SI
	ADDQ      $64, AX
	ADDQ      $64, BX
	DECQ      CX
	JNZ       dotloop
	MOVQ      s0+32(FP), DI
	VMOVUPD   Y0, 0(DI)
	VMOVUPD   Y1, 32(DI)
	MOVQ      s1+40(FP), DI
	VMOVUPD   Y2, 0(DI)
	VMOVUPD   Y3, 32(DI)
	VZEROUPPER
	RET

// func axpy2AVX2(x *float32, a0 float64, y0 *float64, a1 float64, y1 *float64, n int)
// x[j] = float32(x[j] + (a0·y0[j] + a1·y1[j])) for j < n, a positive multiple of 8.
TEXT ·axpy2AVX2(SB), NOSPLIT, $0-48
	MOVQ         x+0(FP), SI
	VBROADCASTSD a0+8(FP), Y10
	MOVQ         y0+16(FP), AX
	VBROADCASTSD a1+24(FP), Y11
	MOVQ         y1+32(FP), BX
	MOVQ         n+40(FP), CX
	SHRQ         $3, CX
axloop:
	VCVTPS2PD  0(SI), Y0
	VCVTPS2PD  16(SI), Y1
	VMULPD     0(AX), Y10, Y2
	VMULPD     0(BX), Y11, Y3
	VADDPD     Y3, Y2, Y2
	VADDPD     Y2, Y0, Y0
	VMULPD     32(AX), Y10, Y4
	VMULPD     32(BX), Y11, Y5
	VADDPD     Y5, Y4, Y4
	VADDPD     Y4, Y1, Y1
	VCVTPD2PSY Y0, X0
	VCVTPD2PSY Y1, X1
	VMOVUPS    X0, 0(SI)
	VMOVUPS    X1, 16(SI)
	ADDQ       $32, SI
	ADDQ       $64, AX
	ADDQ       $64, BX
	DECQ       CX
	JNZ        axloop
	VZEROUPPER
	RET

// func axpy2F32AVX2(x *float32, a0 float64, y0 *float32, a1 float64, y1 *float32, n int)
// axpy2AVX2 with float32 y0 and y1, widened exactly.
TEXT ·axpy2F32AVX2(SB), NOSPLIT, $0-48
	MOVQ         x+0(FP), SI
	VBROADCASTSD a0+8(FP), Y10
	MOVQ         y0+16(FP), AX
	VBROADCASTSD a1+24(FP), Y11
	MOVQ         y1+32(FP), BX
	MOVQ         n+40(FP), CX
	SHRQ         $3, CX
afloop:
	VCVTPS2PD  0(SI), Y0
	VCVTPS2PD  16(SI), Y1
	VCVTPS2PD  0(AX), Y2
	VCVTPS2PD  0(BX), Y3
	VMULPD     Y10, Y2, Y2
	VMULPD     Y11, Y3, Y3
	VADDPD     Y3, Y2, Y2
	VADDPD     Y2, Y0, Y0
	VCVTPS2PD  16(AX), Y4
	VCVTPS2PD  16(BX), Y5
	VMULPD     Y10, Y4, Y4
	VMULPD     Y11, Y5, Y5
	VADDPD     Y5, Y4, Y4
	VADDPD     Y4, Y1, Y1
	VCVTPD2PSY Y0, X0
	VCVTPD2PSY Y1, X1
	VMOVUPS    X0, 0(SI)
	VMOVUPS    X1, 16(SI)
	ADDQ       $32, SI
	ADDQ       $32, AX
	ADDQ       $32, BX
	DECQ       CX
	JNZ        afloop
	VZEROUPPER
	RET

// func axpyTo2AVX2(s0 *float64, a0 float64, s1 *float64, a1 float64, x *float32, n int)
// s0[j] += a0·x[j], then s1[j] += a1·x[j], for j < n, a positive multiple of 8. s0 and
// s1 may be the same array: each block of s1 is read after s0's store.
TEXT ·axpyTo2AVX2(SB), NOSPLIT, $0-48
	MOVQ         s0+0(FP), AX
	VBROADCASTSD a0+8(FP), Y10
	MOVQ         s1+16(FP), BX
	VBROADCASTSD a1+24(FP), Y11
	MOVQ         x+32(FP), SI
	MOVQ         n+40(FP), CX
	SHRQ         $3, CX
atloop:
	VCVTPS2PD 0(SI), Y0
	VCVTPS2PD 16(SI), Y1
	VMULPD    Y10, Y0, Y2
	VADDPD    0(AX), Y2, Y2
	VMOVUPD   Y2, 0(AX)
	VMULPD    Y10, Y1, Y3
	VADDPD    32(AX), Y3, Y3
	VMOVUPD   Y3, 32(AX)
	VMULPD    Y11, Y0, Y4
	VADDPD    0(BX), Y4, Y4
	VMOVUPD   Y4, 0(BX)
	VMULPD    Y11, Y1, Y5
	VADDPD    32(BX), Y5, Y5
	VMOVUPD   Y5, 32(BX)
	ADDQ      $32, SI
	ADDQ      $64, AX
	ADDQ      $64, BX
	DECQ      CX
	JNZ       atloop
	VZEROUPPER
	RET
