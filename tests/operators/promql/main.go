// Command promql parses PromQL with Prometheus' own parser (promql/parser) for the dashboard test:
// a JSON list of expressions on stdin, for each one on stdout its parse error, or the metric names
// and label names its selectors match on and the labels its aggregations group by.
package main

import (
	"encoding/json"
	"os"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
)

type selector struct {
	Metric string   `json:"metric"`
	Labels []string `json:"labels"`
}

type result struct {
	Expr      string     `json:"expr"`
	Error     string     `json:"error,omitempty"`
	Selectors []selector `json:"selectors"`
	Grouping  []string   `json:"grouping"`
}

func inspect(p parser.Parser, expr string) result {
	out := result{Expr: expr, Selectors: []selector{}, Grouping: []string{}}
	ast, err := p.ParseExpr(expr)
	if err != nil {
		out.Error = err.Error()
		return out
	}
	parser.Inspect(ast, func(node parser.Node, _ []parser.Node) error {
		switch n := node.(type) {
		case *parser.VectorSelector:
			s := selector{Metric: n.Name, Labels: []string{}}
			for _, m := range n.LabelMatchers {
				if m.Name != labels.MetricName {
					s.Labels = append(s.Labels, m.Name)
				}
			}
			out.Selectors = append(out.Selectors, s)
		case *parser.AggregateExpr:
			out.Grouping = append(out.Grouping, n.Grouping...)
		}
		return nil
	})
	return out
}

func main() {
	var exprs []string
	if err := json.NewDecoder(os.Stdin).Decode(&exprs); err != nil {
		panic(err)
	}
	p := parser.NewParser(parser.Options{})
	results := make([]result, 0, len(exprs))
	for _, e := range exprs {
		results = append(results, inspect(p, e))
	}
	if err := json.NewEncoder(os.Stdout).Encode(results); err != nil {
		panic(err)
	}
}
