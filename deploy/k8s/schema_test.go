package k8s

import (
	"bufio"
	"errors"
	"io"
	"os"
	"strings"
	"testing"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// pytorchJob is the part of the training operator's kubeflow.org/v1 PyTorchJob that the
// manifest may use, with Kubernetes' own types for the metadata and the pod templates. (The
// operator's Go module would bring the whole operator in for one struct.)
type pytorchJob struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		NprocPerNode        *string                 `json:"nprocPerNode,omitempty"`
		PyTorchReplicaSpecs map[string]*replicaSpec `json:"pytorchReplicaSpecs"`
	} `json:"spec"`
}

type replicaSpec struct {
	Replicas      *int32                 `json:"replicas,omitempty"`
	RestartPolicy string                 `json:"restartPolicy,omitempty"`
	Template      corev1.PodTemplateSpec `json:"template"`
}

// documents splits a manifest into its YAML documents (comment-only ones dropped).
func documents(t *testing.T, path string) [][]byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r := utilyaml.NewYAMLReader(bufio.NewReader(f))
	var docs [][]byte
	for {
		d, err := r.Read()
		if errors.Is(err, io.EOF) {
			return docs
		}
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		var v any
		if err := yaml.Unmarshal(d, &v); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if v != nil {
			docs = append(docs, d)
		}
	}
}

// decodeStrict decodes one document into the Kubernetes type its kind names: an unknown
// or misspelt field, a duplicate field or a value of the wrong type is an error.
func decodeStrict(doc []byte) (any, error) {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal(doc, &tm); err != nil {
		return nil, err
	}
	var obj any
	switch tm.APIVersion + " " + tm.Kind {
	case "v1 Service":
		obj = &corev1.Service{}
	case "batch/v1 Job":
		obj = &batchv1.Job{}
	case "kubeflow.org/v1 PyTorchJob":
		obj = &pytorchJob{}
	default:
		return nil, &unknownKind{tm}
	}
	return obj, yaml.UnmarshalStrict(doc, obj)
}

type unknownKind struct{ tm metav1.TypeMeta }

func (u *unknownKind) Error() string {
	return "no schema for apiVersion " + u.tm.APIVersion + " kind " + u.tm.Kind
}

// TestManifestsSchema decodes every document of the manifests strictly into Kubernetes'
// API types (k8s.io/api), then checks what the types cannot: the values goddp's jobs need.
// A misspelt field must fail the same decoding (checked on a damaged copy).
func TestManifestsSchema(t *testing.T) {
	kinds := map[string]int{}
	for _, path := range []string{"pytorchjob.yaml", "indexed-job.yaml"} {
		for i, doc := range documents(t, path) {
			obj, err := decodeStrict(doc)
			if err != nil {
				t.Fatalf("%s document %d: %v", path, i, err)
			}
			switch o := obj.(type) {
			case *corev1.Service:
				kinds["Service"]++
				if o.Spec.ClusterIP != corev1.ClusterIPNone {
					t.Errorf("%s: Service %s is not headless (clusterIP %q)", path, o.Name, o.Spec.ClusterIP)
				}
			case *batchv1.Job:
				kinds["Job"]++
				if o.Spec.CompletionMode == nil || *o.Spec.CompletionMode != batchv1.IndexedCompletion {
					t.Errorf("%s: Job %s is not an Indexed Job", path, o.Name)
				}
				checkPod(t, path, o.Spec.Template.Spec, "", []corev1.RestartPolicy{corev1.RestartPolicyNever, corev1.RestartPolicyOnFailure})
			case *pytorchJob:
				kinds["PyTorchJob"]++
				if len(o.Spec.PyTorchReplicaSpecs) == 0 {
					t.Errorf("%s: no pytorchReplicaSpecs", path)
				}
				for name, rs := range o.Spec.PyTorchReplicaSpecs {
					if name != "Master" && name != "Worker" {
						t.Errorf("%s: replica type %q: the operator knows Master and Worker", path, name)
					}
					switch rs.RestartPolicy {
					case "", "Always", "OnFailure", "Never", "ExitCode":
					default:
						t.Errorf("%s: %s restartPolicy %q", path, name, rs.RestartPolicy)
					}
					checkPod(t, path+" "+name, rs.Template.Spec, "pytorch", nil)
				}
			}
		}
	}
	if kinds["Service"] != 1 || kinds["Job"] != 1 || kinds["PyTorchJob"] != 1 {
		t.Errorf("documents per kind %v, want one Service, one Job, one PyTorchJob", kinds)
	}

	docs := documents(t, "indexed-job.yaml")
	for _, c := range []struct{ what, from, to string }{
		{"a misspelt field", "containers:", "contaners:"},
		{"a wrong type", "completions: 4", "completions: four"},
	} {
		var damaged []byte
		for _, d := range docs {
			if s := string(d); strings.Contains(s, c.from) {
				damaged = []byte(strings.Replace(s, c.from, c.to, 1))
			}
		}
		if damaged == nil {
			t.Fatalf("indexed-job.yaml has no %q to damage", c.from)
		}
		if _, err := decodeStrict(damaged); err == nil {
			t.Errorf("%s (%s → %s) passed the strict decoding", c.what, c.from, c.to)
		}
	}
}

// checkPod checks a pod template's spec: at least one container, each with an image, the
// one named container (when name is set), a job token from a Secret, and an allowed
// restart policy (when allowed is set).
func checkPod(t *testing.T, where string, spec corev1.PodSpec, name string, allowed []corev1.RestartPolicy) {
	t.Helper()
	if len(spec.Containers) == 0 {
		t.Errorf("%s: no containers", where)
	}
	found := name == ""
	for _, c := range spec.Containers {
		if c.Image == "" {
			t.Errorf("%s: container %s has no image", where, c.Name)
		}
		found = found || c.Name == name
		token := false
		for _, e := range c.Env {
			if e.Name == "GODDP_TOKEN" && e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
				token = true
			}
		}
		if !token {
			t.Errorf("%s: container %s takes no GODDP_TOKEN from a Secret", where, c.Name)
		}
	}
	if !found {
		t.Errorf("%s: no container named %q (the operator looks for it)", where, name)
	}
	if allowed != nil {
		ok := false
		for _, a := range allowed {
			ok = ok || spec.RestartPolicy == a
		}
		if !ok {
			t.Errorf("%s: restartPolicy %q, want one of %v", where, spec.RestartPolicy, allowed)
		}
	}
}
