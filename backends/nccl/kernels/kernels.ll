; kernels.ll: the device kernels of backends/nccl's procgroup.Device (Group.ScaleAsync,
; Group.ConvertAsync), in LLVM IR. kernels.ptx is generated from it by gen.sh (llc, NVPTX
; backend) and embedded in the package; the driver JIT-compiles the PTX for the device at
; cuModuleLoadData. One thread per element; blocks of 256 threads. FMA contraction is off
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

!nvvm.annotations = !{!0, !1, !2, !3, !4, !5}
!0 = !{void (float*, float*, i64, float, i32)* @goddp_scale_f32, !"kernel", i32 1}
!1 = !{void (double*, double*, i64, double, i32)* @goddp_scale_f64, !"kernel", i32 1}
!2 = !{void (i16*, float*, i64)* @goddp_f32_to_f16, !"kernel", i32 1}
!3 = !{void (float*, i16*, i64)* @goddp_f16_to_f32, !"kernel", i32 1}
!4 = !{void (i16*, i32*, i64)* @goddp_f32_to_bf16, !"kernel", i32 1}
!5 = !{void (i32*, i16*, i64)* @goddp_bf16_to_f32, !"kernel", i32 1}
