; kernels.ll: the device kernels of backends/nccl's procgroup.Device (Group.ScaleAsync,
; Group.ConvertAsync) and procgroup.DeviceBLAS (Group.OrthonormalizeAsync), in LLVM IR. kernels.ptx is generated from it by gen.sh (llc, NVPTX
; backend) and embedded in the package; the driver JIT-compiles the PTX for the device at
; cuModuleLoadData. One thread per element, blocks of 256 threads (goddp_orth_f32: one
; thread in all). FMA contraction is off
; (gen.sh: -nvptx-fma-level=0) so that a·x + y rounds twice, exactly as on the host.
target datalayout = "e-i64:64-i128:128-v16:16-v32:32-n16:32:64"
target triple = "nvptx64-nvidia-cuda"

declare i32 @llvm.nvvm.read.ptx.sreg.tid.x()
declare i32 @llvm.nvvm.read.ptx.sreg.ctaid.x()
declare i32 @llvm.nvvm.read.ptx.sreg.ntid.x()

define internal i64 @index() alwaysinline {
  %tid = call i32 @llvm.nvvm.read.ptx.sreg.tid.x()
  %cta = call i32 @llvm.nvvm.read.ptx.sreg.ctaid.x()
  %ntid = call i32 @llvm.nvvm.read.ptx.sreg.ntid.x()
  %t = zext i32 %tid to i64
  %c = zext i32 %cta to i64
  %b = zext i32 %ntid to i64
  %base = mul i64 %c, %b
  %i = add i64 %base, %t
  ret i64 %i
}

; dst[i] = a*src[i], or dst[i] += a*src[i] when add != 0.
define void @goddp_scale_f32(float* %dst, float* %src, i64 %n, float %a, i32 %add) {
entry:
  %i = call i64 @index()
  %in = icmp ult i64 %i, %n
  br i1 %in, label %body, label %exit
body:
  %ps = getelementptr float, float* %src, i64 %i
  %v = load float, float* %ps
  %sv = fmul float %v, %a
  %pd = getelementptr float, float* %dst, i64 %i
  %isadd = icmp ne i32 %add, 0
  br i1 %isadd, label %doadd, label %store
doadd:
  %old = load float, float* %pd
  %sum = fadd float %old, %sv
  br label %store
store:
  %r = phi float [ %sv, %body ], [ %sum, %doadd ]
  store float %r, float* %pd
  br label %exit
exit:
  ret void
}

define void @goddp_scale_f64(double* %dst, double* %src, i64 %n, double %a, i32 %add) {
entry:
  %i = call i64 @index()
  %in = icmp ult i64 %i, %n
  br i1 %in, label %body, label %exit
body:
  %ps = getelementptr double, double* %src, i64 %i
  %v = load double, double* %ps
  %sv = fmul double %v, %a
  %pd = getelementptr double, double* %dst, i64 %i
  %isadd = icmp ne i32 %add, 0
  br i1 %isadd, label %doadd, label %store
doadd:
  %old = load double, double* %pd
  %sum = fadd double %old, %sv
  br label %store
store:
  %r = phi double [ %sv, %body ], [ %sum, %doadd ]
  store double %r, double* %pd
  br label %exit
exit:
  ret void
}

; IEEE half: cvt.rn.f16.f32 and back (exact).
define void @goddp_f32_to_f16(i16* %dst, float* %src, i64 %n) {
entry:
  %i = call i64 @index()
  %in = icmp ult i64 %i, %n
  br i1 %in, label %body, label %exit
body:
  %ps = getelementptr float, float* %src, i64 %i
  %v = load float, float* %ps
  %h = fptrunc float %v to half
  %hb = bitcast half %h to i16
  %pd = getelementptr i16, i16* %dst, i64 %i
  store i16 %hb, i16* %pd
  br label %exit
exit:
  ret void
}

define void @goddp_f16_to_f32(float* %dst, i16* %src, i64 %n) {
entry:
  %i = call i64 @index()
  %in = icmp ult i64 %i, %n
  br i1 %in, label %body, label %exit
body:
  %ps = getelementptr i16, i16* %src, i64 %i
  %hb = load i16, i16* %ps
  %h = bitcast i16 %hb to half
  %v = fpext half %h to float
  %pd = getelementptr float, float* %dst, i64 %i
  store float %v, float* %pd
  br label %exit
exit:
  ret void
}

; bfloat16 with integer arithmetic (any architecture), as procgroup.BF16FromFloat32:
; NaN stays a quiet NaN, else round to nearest even.
define void @goddp_f32_to_bf16(i16* %dst, i32* %src, i64 %n) {
entry:
  %i = call i64 @index()
  %in = icmp ult i64 %i, %n
  br i1 %in, label %body, label %exit
body:
  %ps = getelementptr i32, i32* %src, i64 %i
  %b = load i32, i32* %ps
  %abs = and i32 %b, 2147483647
  %nan = icmp ugt i32 %abs, 2139095040
  %hi = lshr i32 %b, 16
  %q = or i32 %hi, 64
  %odd = and i32 %hi, 1
  %bias = add i32 %odd, 32767
  %rb = add i32 %b, %bias
  %r = lshr i32 %rb, 16
  %sel = select i1 %nan, i32 %q, i32 %r
  %h = trunc i32 %sel to i16
  %pd = getelementptr i16, i16* %dst, i64 %i
  store i16 %h, i16* %pd
  br label %exit
exit:
  ret void
}

define void @goddp_bf16_to_f32(i32* %dst, i16* %src, i64 %n) {
entry:
  %i = call i64 @index()
  %in = icmp ult i64 %i, %n
  br i1 %in, label %body, label %exit
body:
  %ps = getelementptr i16, i16* %src, i64 %i
  %h = load i16, i16* %ps
  %w = zext i16 %h to i32
  %b = shl i32 %w, 16
  %pd = getelementptr i32, i32* %dst, i64 %i
  store i32 %b, i32* %pd
  br label %exit
exit:
  ret void
}

declare double @llvm.sqrt.f64(double)

; dot(x, y, n) = sum over i in order of double(x[i])*double(y[i]), from 0.
define internal double @dot(float* %x, float* %y, i64 %n) alwaysinline {
entry:
  br label %loop
loop:
  %i = phi i64 [ 0, %entry ], [ %i1, %body ]
  %s = phi double [ 0.0, %entry ], [ %s1, %body ]
  %done = icmp uge i64 %i, %n
  br i1 %done, label %exit, label %body
body:
  %px = getelementptr float, float* %x, i64 %i
  %vx = load float, float* %px
  %py = getelementptr float, float* %y, i64 %i
  %vy = load float, float* %py
  %dx = fpext float %vx to double
  %dy = fpext float %vy to double
  %p = fmul double %dx, %dy
  %s1 = fadd double %s, %p
  %i1 = add i64 %i, 1
  br label %loop
exit:
  ret double %s
}

; goddp_orth_f32(a, rows, cols, seed): modified Gram-Schmidt of the cols columns of the
; rows×cols column-major float32 matrix a, in place, in float64 arithmetic (each element
; rounded to float32 when stored), by one thread: procgroup.DeviceBLAS.OrthonormalizeAsync,
; the order of operations of the fake driver's C version. For column c, try t:
;   before = sqrt(dot(col, col)); twice: for k < c: col -= dot(col, a_k)·a_k;
;   norm = sqrt(dot(col, col)); good = norm > 1e-5·before && norm > 0 && norm < inf;
;   good or t = 3: col *= (good ? 1/norm : 0), next column;
;   else col = SplitMix64 draws from seed ^ (c+1 + t<<32), uniform in [-1, 1); t+1.
define void @goddp_orth_f32(float* %a, i64 %rows, i32 %cols, i64 %seed) {
entry:
  %cols64 = zext i32 %cols to i64
  br label %colloop
colloop:
  %c = phi i64 [ 0, %entry ], [ %c1, %colnext ]
  %cdone = icmp uge i64 %c, %cols64
  br i1 %cdone, label %exit, label %colbody
colbody:
  %coff = mul i64 %c, %rows
  %col = getelementptr float, float* %a, i64 %coff
  br label %try
try:
  %t = phi i64 [ 0, %colbody ], [ %t1, %drawdone ]
  %bb = call double @dot(float* %col, float* %col, i64 %rows)
  %before = call double @llvm.sqrt.f64(double %bb)
  br label %passloop
passloop:
  %pass = phi i64 [ 0, %try ], [ %pass1, %passnext ]
  %passdone = icmp uge i64 %pass, 2
  br i1 %passdone, label %normcheck, label %projloop
projloop:
  %k = phi i64 [ 0, %passloop ], [ %k1, %projdone ]
  %kdone = icmp uge i64 %k, %c
  br i1 %kdone, label %passnext, label %proj
passnext:
  %pass1 = add i64 %pass, 1
  br label %passloop
proj:
  %koff = mul i64 %k, %rows
  %prev = getelementptr float, float* %a, i64 %koff
  %d = call double @dot(float* %col, float* %prev, i64 %rows)
  br label %subloop
subloop:
  %i = phi i64 [ 0, %proj ], [ %i1, %subbody ]
  %idone = icmp uge i64 %i, %rows
  br i1 %idone, label %projdone, label %subbody
subbody:
  %pc = getelementptr float, float* %col, i64 %i
  %vc = load float, float* %pc
  %pp = getelementptr float, float* %prev, i64 %i
  %vp = load float, float* %pp
  %xc = fpext float %vc to double
  %xp = fpext float %vp to double
  %dp = fmul double %d, %xp
  %nv = fsub double %xc, %dp
  %nf = fptrunc double %nv to float
  store float %nf, float* %pc
  %i1 = add i64 %i, 1
  br label %subloop
projdone:
  %k1 = add i64 %k, 1
  br label %projloop
normcheck:
  %nn = call double @dot(float* %col, float* %col, i64 %rows)
  %norm = call double @llvm.sqrt.f64(double %nn)
  %thr = fmul double 0x3EE4F8B588E368F1, %before
  %g1 = fcmp ogt double %norm, %thr
  %g2 = fcmp ogt double %norm, 0.0
  %g3 = fcmp olt double %norm, 0x7FF0000000000000
  %g12 = and i1 %g1, %g2
  %good = and i1 %g12, %g3
  %last = icmp eq i64 %t, 3
  %stop = or i1 %good, %last
  br i1 %stop, label %scale, label %redraw
scale:
  %inv0 = fdiv double 1.0, %norm
  %inv = select i1 %good, double %inv0, double 0.0
  br label %scaleloop
scaleloop:
  %j = phi i64 [ 0, %scale ], [ %j1, %scalebody ]
  %jdone = icmp uge i64 %j, %rows
  br i1 %jdone, label %colnext, label %scalebody
scalebody:
  %ps = getelementptr float, float* %col, i64 %j
  %vs = load float, float* %ps
  %xs = fpext float %vs to double
  %ms = fmul double %xs, %inv
  %fs = fptrunc double %ms to float
  store float %fs, float* %ps
  %j1 = add i64 %j, 1
  br label %scaleloop
colnext:
  %c1 = add i64 %c, 1
  br label %colloop
redraw:
  %tsh = shl i64 %t, 32
  %cp1 = add i64 %c, 1
  %mix = add i64 %cp1, %tsh
  %g0 = xor i64 %seed, %mix
  br label %drawloop
drawloop:
  %q = phi i64 [ 0, %redraw ], [ %q1, %drawbody ]
  %st = phi i64 [ %g0, %redraw ], [ %st1, %drawbody ]
  %qdone = icmp uge i64 %q, %rows
  br i1 %qdone, label %drawdone, label %drawbody
drawbody:
  %st1 = add i64 %st, -7046029254386353131
  %z1s = lshr i64 %st1, 30
  %z1x = xor i64 %st1, %z1s
  %z1 = mul i64 %z1x, -4658895280553007687
  %z2s = lshr i64 %z1, 27
  %z2x = xor i64 %z1, %z2s
  %z2 = mul i64 %z2x, -7723592293110705685
  %z3s = lshr i64 %z2, 31
  %z3 = xor i64 %z2, %z3s
  %hi = lshr i64 %z3, 11
  %fh = uitofp i64 %hi to double
  %u0 = fmul double %fh, 0x3CB0000000000000
  %u = fsub double %u0, 1.0
  %uf = fptrunc double %u to float
  %pd = getelementptr float, float* %col, i64 %q
  store float %uf, float* %pd
  %q1 = add i64 %q, 1
  br label %drawloop
drawdone:
  %t1 = add i64 %t, 1
  br label %try
exit:
  ret void
}

!nvvm.annotations = !{!0, !1, !2, !3, !4, !5, !6}
!0 = !{void (float*, float*, i64, float, i32)* @goddp_scale_f32, !"kernel", i32 1}
!1 = !{void (double*, double*, i64, double, i32)* @goddp_scale_f64, !"kernel", i32 1}
!2 = !{void (i16*, float*, i64)* @goddp_f32_to_f16, !"kernel", i32 1}
!3 = !{void (float*, i16*, i64)* @goddp_f16_to_f32, !"kernel", i32 1}
!4 = !{void (i16*, i32*, i64)* @goddp_f32_to_bf16, !"kernel", i32 1}
!5 = !{void (i32*, i16*, i64)* @goddp_bf16_to_f32, !"kernel", i32 1}
!6 = !{void (float*, i64, i32, i64)* @goddp_orth_f32, !"kernel", i32 1}
