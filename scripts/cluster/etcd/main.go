// etcd for the cluster tests, built from the same etcd server module the pinned Kubernetes release
// depends on (go.mod), so the API server meets the etcd version it was released against.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
