//go:build amd64 && !purego

#include "textflag.h"

// func addF32AVX2(dst, src *float32, n int)
// dst[i] += src[i] for i < n; n is a multiple of 32.
TEXT ·addF32AVX2(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	SHRQ $5, CX
	JZ   done32
loop32:
	VMOVUPS 0(DI), Y0
	VMOVUPS 32(DI), Y1
	VMOVUPS 64(DI), Y2
	VMOVUPS 96(DI), Y3
	VADDPS  0(SI), Y0, Y0
	VADDPS  32(SI), Y1, Y1
	VADDPS  64(SI), Y2, Y2
	VADDPS  96(SI), Y3, Y3
	VMOVUPS Y0, 0(DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	ADDQ    $128, DI
	ADDQ    $128, SI
	DECQ    CX
	JNZ     loop32
	VZEROUPPER
done32:
	RET

// func addF64AVX2(dst, src *float64, n int)
// dst[i] += src[i] for i < n; n is a multiple of 16.
TEXT ·addF64AVX2(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	SHRQ $4, CX
	JZ   done64
loop64:
	VMOVUPD 0(DI), Y0
	VMOVUPD 32(DI), Y1
	VMOVUPD 64(DI), Y2
	VMOVUPD 96(DI), Y3
	VADDPD  0(SI), Y0, Y0
	VADDPD  32(SI), Y1, Y1
	VADDPD  64(SI), Y2, Y2
	VADDPD  96(SI), Y3, Y3
	VMOVUPD Y0, 0(DI)
	VMOVUPD Y1, 32(DI)
	VMOVUPD Y2, 64(DI)
	VMOVUPD Y3, 96(DI)
	ADDQ    $128, DI
	ADDQ    $128, SI
	DECQ    CX
	JNZ     loop64
	VZEROUPPER
done64:
	RET

// func addF32AVX2To(dst, a, b *float32, n int)
// dst[i] = a[i] + b[i] for i < n (the same vaddps, operands in the same roles, as
// addF32AVX2 with dst = a); n is a multiple of 32. dst may alias a or b.
TEXT ·addF32AVX2To(SB), NOSPLIT, $0-32
	MOVQ dst+0(FP), DI
	MOVQ a+8(FP), AX
	MOVQ b+16(FP), SI
	MOVQ n+24(FP), CX
	SHRQ $5, CX
	JZ   doneto32
loopto32:
	VMOVUPS 0(AX), Y0
	VMOVUPS 32(AX), Y1
	VMOVUPS 64(AX), Y2
	VMOVUPS 96(AX), Y3
	VADDPS  0(SI), Y0, Y0
	VADDPS  32(SI), Y1, Y1
	VADDPS  64(SI), Y2, Y2
	VADDPS  96(SI), Y3, Y3
	VMOVUPS Y0, 0(DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	ADDQ    $128, DI
	ADDQ    $128, AX
	ADDQ    $128, SI
	DECQ    CX
	JNZ     loopto32
	VZEROUPPER
doneto32:
	RET

// func addF64AVX2To(dst, a, b *float64, n int)
// dst[i] = a[i] + b[i] for i < n; n is a multiple of 16. dst may alias a or b.
TEXT ·addF64AVX2To(SB), NOSPLIT, $0-32
	MOVQ dst+0(FP), DI
	MOVQ a+8(FP), AX
	MOVQ b+16(FP), SI
	MOVQ n+24(FP), CX
	SHRQ $4, CX
	JZ   doneto64
loopto64:
	VMOVUPD 0(AX), Y0
	VMOVUPD 32(AX), Y1
	VMOVUPD 64(AX), Y2
	VMOVUPD 96(AX), Y3
	VADDPD  0(SI), Y0, Y0
	VADDPD  32(SI), Y1, Y1
	VADDPD  64(SI), Y2, Y2
	VADDPD  96(SI), Y3, Y3
	VMOVUPD Y0, 0(DI)
	VMOVUPD Y1, 32(DI)
	VMOVUPD Y2, 64(DI)
	VMOVUPD Y3, 96(DI)
	ADDQ    $128, DI
	ADDQ    $128, AX
	ADDQ    $128, SI
	DECQ    CX
	JNZ     loopto64
	VZEROUPPER
doneto64:
	RET
