package sgemm

//go:generate sh -c "cd _gen && go run . -out ../kernel_amd64.s -stubs ../kernel_amd64.go -pkg sgemm -table ../ktable_amd64.go"
